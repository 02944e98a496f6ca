"""``kvwise size``: KV-cache bytes per token, request and batch of a model (or of a shape given
by flags), under MHA / GQA / MQA and every KV format: ``kvwise.perf.sizing``'s report. Pure
Python: it answers without torch."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from kvwise.core.kv_spec import kv_formats

    p.add_argument(
        "--model",
        default=None,
        help="config.json, HF directory or .gguf "
        "(default: the default model); or give the shape with the flags below",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads)")
    p.add_argument("--head-dim", type=int, default=None)
    # the formats that can be sized: the pool's and fp8 (a size only)
    p.add_argument("--dtype", default="float16", choices=kv_formats("size"))
    p.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    p.add_argument("--batch", type=int, default=16, help="requests per batch")
    p.add_argument("--memory", default=None, help="how many tokens fit in this, e.g. 24GiB")


def run(args: argparse.Namespace) -> int:
    from kvwise.perf.sizing import KVShape, gguf_weight_report, report, shape_from_model
    from kvwise.utils import parse_bytes

    flags = (args.layers, args.heads, args.head_dim)
    if any(f is not None for f in flags):
        if any(f is None for f in flags):
            raise ValueError("layers: --layers, --heads and --head-dim go together")
        shape = KVShape(
            args.layers, args.heads, args.kv_heads or args.heads, args.head_dim, args.dtype
        )
    else:
        shape, name = shape_from_model(args.model, args.dtype)
        print(f"model: {name}")
        weights = gguf_weight_report(args.model)
        if weights is not None:
            print('weights as quantization="auto" holds them:')
            print(weights + "\n")
    memory = parse_bytes(args.memory, "memory") if args.memory else None
    print(report(shape, args.tokens, args.batch, memory))
    return 0
