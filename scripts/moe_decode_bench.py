"""Decode speed of a mixture-of-experts model with Qwen3-30B-A3B's layer shapes (hidden 2,048,
128 experts of 768, 8 a token, 32 query / 4 KV heads of 128) but few layers and random
weights (issue 48): kvwise with int4 and float32 experts against transformers' float32, one
sequence, greedy, after a 32-token prompt; medians of 5 interleaved reps.

    .venv/bin/python scripts/moe_decode_bench.py DIR [--layers 2]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from kvwise import LLM, SamplingParams

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=4096,
)
NEW = 32


def make(directory: Path, layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SHAPE, num_hidden_layers=layers)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.02)
    if not (directory / "config.json").exists():
        hf.save_pretrained(directory)
        vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(directory / "tokenizer.json"))
    return hf


def hf_decode(hf, prompt) -> float:
    with torch.inference_mode():
        res = hf(torch.tensor([prompt]), use_cache=True)
        token = int(res.logits[0, -1].argmax())
        t = time.perf_counter()
        for _ in range(NEW):
            res = hf(torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True)
            token = int(res.logits[0, -1].argmax())
        return NEW / (time.perf_counter() - t)


def kvwise_decode(llm, prompt) -> float:
    """Tokens/s of NEW decodes after the prompt (cached first, so the timed run decodes; its
    one extra step, the first token from the kept last row, is counted against it)."""
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=NEW + 1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([prompt], params)
    return NEW / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    args.dir.mkdir(parents=True, exist_ok=True)
    hf = make(args.dir, args.layers)
    prompt = [(i * 7919) % 30000 + 10 for i in range(32)]
    engine = dict(
        progress=False, kv_cache_memory="256MiB", kv_host_memory="off", kv_disk_path="off"
    )
    runs = {"kvwise int4": [], "kvwise float32": [], "transformers float32": []}
    llms = {
        "kvwise int4": LLM(model=str(args.dir), quantization="int4", **engine),
        "kvwise float32": LLM(model=str(args.dir), quantization="none", **engine),
    }
    for _ in range(args.reps):
        for name, llm in llms.items():
            runs[name].append(kvwise_decode(llm, prompt))
        runs["transformers float32"].append(hf_decode(hf, prompt))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in medians.items():
        print(f"{k}: {v:.2f} tok/s  ({', '.join(f'{x:.2f}' for x in runs[k])})")
    if args.out:
        args.out.write_text(json.dumps({"medians": medians, "runs": runs, "layers": args.layers}))


if __name__ == "__main__":
    main()
