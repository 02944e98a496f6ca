"""Make the GGUF files issue 27 measures, as a user would with llama.cpp's own tools.

  python scripts/make_gguf_variants.py --out DIR --llama-cpp SRC --quantize BIN [--big]

1. The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by transformers and saved as an
   HF directory (DIR/smollm2-hf), or with --big a random Llama-shaped 1B model (16 layers,
   hidden 2048, 32/8 heads, intermediate 8192, the default model's tokenizer; DIR/llama1b-hf),
   or with --moe qwen3moe a random model of Qwen3-30B-A3B's layer shapes (hidden 2048, 32/4
   heads of 128, 128 experts of 768, 8 a token) with --layers of them (default 4) and the
   default model's tokenizer (DIR/qwen3moe-LNN-hf, bfloat16: 1.2 GB a layer), or with --moe
   gpt-oss one of gpt-oss-20b's (hidden 2880, 64/8 heads of 64, 32 experts of 2880, 4 a token,
   sinks, windows of 128 on alternate layers, YaRN; DIR/gpt-oss-LNN-hf, 1.6 GB a layer).
2. llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` (bf16 for --moe) (from SRC) ->
   NAME-f32.gguf (NAME-bf16.gguf).
3. ``llama-quantize`` (BIN) -> NAME-{Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0,...}.gguf.
A benchmark tool: nothing here runs in the test suite. Files that exist are kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "Q5_0", "Q5_1")


# Qwen3-30B-A3B's layer shapes (its config.json), the layer count chosen by --layers
QWEN3_MOE = dict(
    hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip


def _tokenizer():
    import transformers

    from kvwise.models.default import default_model_path

    gguf = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


# gpt-oss-20b's (its config.json), the layer count chosen by --layers
GPT_OSS = dict(
    hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                         beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    tie_word_embeddings=False,
)  # fmt: skip


def moe_dir(out: Path, kind: str, layers: int) -> Path:
    """A random MoE of ``kind``'s layer shapes (bfloat16), ``layers`` deep."""
    import torch
    import transformers

    target = out / f"{kind}-L{layers}-hf"
    if (target / "config.json").is_file():
        return target
    tokenizer = _tokenizer()
    shape, cls = (
        (QWEN3_MOE, transformers.Qwen3MoeConfig)
        if kind == "qwen3moe"
        else (dict(GPT_OSS, layer_types=["sliding_attention", "full_attention"] * (layers // 2)),
              transformers.GptOssConfig)
    )  # fmt: skip
    config = cls(
        vocab_size=len(tokenizer), num_hidden_layers=layers, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.uniform_(0.5, 1.5) if "norm" in name else weight.normal_(0.0, 0.02)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def hf_dir(out: Path, big: bool) -> Path:
    import torch
    import transformers

    from kvwise.bench.vllm_peer import hf_directory

    if not big:
        return hf_directory(out / "smollm2-hf")
    target = out / "llama1b-hf"
    if (target / "config.json").is_file():
        return target
    tokenizer = _tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    p.add_argument("--quantize", type=Path, required=True, help="the llama-quantize binary")
    p.add_argument("--big", action="store_true", help="the random 1B Llama-shaped model")
    p.add_argument("--moe", choices=["qwen3moe", "gpt-oss"], help="a random MoE model")
    p.add_argument("--layers", type=int, default=4, help="--moe: its layers")
    p.add_argument("--types", default=",".join(TYPES))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.moe:
        source, name = moe_dir(args.out, args.moe, args.layers), f"{args.moe}-L{args.layers}"
        outtype = "bf16"
    else:
        source, name, outtype = (
            hf_dir(args.out, args.big),
            "llama1b" if args.big else "smollm2",
            "f32",
        )
    f32 = args.out / f"{name}-{outtype}.gguf"
    if not f32.is_file():
        subprocess.run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"),
                        str(source), "--outtype", outtype, "--outfile", str(f32)], check=True)  # fmt: skip
    for kind in args.types.split(","):
        target = args.out / f"{name}-{kind}.gguf"
        if not target.is_file():
            subprocess.run([str(args.quantize), str(f32), str(target), kind], check=True,
                           capture_output=True)  # fmt: skip
        print(f"{target}  {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
