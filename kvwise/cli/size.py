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
    from kvwise.perf.sizing import (
        KVShape,
        gguf_weight_report,
        hybrid_summary,
        report,
        shape_from_model,
    )
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
    latent = (
        None
        if any(f is not None for f in flags)
        else _latent(args.model, args.dtype, args.tokens, memory)
    )
    print(report(shape, args.tokens, args.batch, memory, latent=latent is not None))
    if latent is not None:
        print("\n" + latent)
    if not any(f is not None for f in flags):
        hybrid = hybrid_spec(args.model, shape)
        if hybrid is not None:  # sliding-window layers: what the hybrid KV cache holds
            lengths = tuple(sorted({args.tokens, 2048, 8192, 32768}))
            print(
                "\nKV groups (the hybrid KV cache; --no-hybrid-kv-cache: all-full): "
                + hybrid_summary(hybrid, lengths)
            )
    return 0


def _latent(model, dtype: str, tokens: int, memory: int | None) -> str | None:
    """``sizing.latent_summary`` of a config.json naming latent attention (None otherwise,
    without loading any family: torch)."""
    import json

    from kvwise.perf.sizing import arch_from_model, latent_summary, model_file

    path = model_file(model)
    try:
        if path.suffix == ".gguf" or not json.loads(path.read_text()).get("kv_lora_rank"):
            return None
    except (OSError, ValueError):
        return None
    arch, _ = arch_from_model(model)
    return latent_summary(arch, dtype, tokens, memory)


def _may_slide(model) -> bool:
    """Whether a model may have sliding-window layers: a GGUF's metadata names a window, a
    config.json a sliding_window or layer_types."""
    import json

    from kvwise.perf.gguf_meta import read_scalars
    from kvwise.perf.sizing import model_file

    path = model_file(model)
    if path.suffix == ".gguf":
        meta = read_scalars(path) or {}
        return any(k.endswith(".attention.sliding_window") for k in meta)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return True  # the full reader decides, with its own errors
    return bool(config.get("sliding_window") or config.get("layer_types"))


def hybrid_spec(model, shape):
    """The hybrid KV page spec of a model with sliding-window layers (None: none)."""
    from kvwise.core.kv_spec import KVSpec, kv_groups
    from kvwise.models import registry
    from kvwise.perf.sizing import arch_from_model

    if not _may_slide(model):
        return None  # (without loading the model's family: torch)
    arch, _ = arch_from_model(model)
    kinds = registry.family_for(arch.architecture).attention_kinds(arch)
    groups = kv_groups([k.sliding_window or 0 for k in kinds])
    if not groups:
        return None
    base = shape.spec
    return KVSpec(
        len(groups[0].layers),
        base.num_kv_heads,
        base.head_dim,
        base.block_size,
        base.dtype,
        groups=groups,
    )
