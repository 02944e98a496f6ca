"""Decode speed under a JSON schema vs unconstrained, same engine, rounds interleaved.

  python scripts/grammar_overhead.py [--model M] [--batches 1,16] [--rounds 5] [--tokens 128]
      [--json OUT]

Each round runs B chat requests at once, unconstrained, then under a JSON schema (an object
with one long string field: the model keeps writing), greedy; the decode rate is each
request's output tokens after the first over the time from its first token to its last, the
round's figure the mean over its requests. Prints the medians and their ratio as JSON. A
benchmark tool: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvwise import LLM, SamplingParams
from kvwise.types import StructuredOutput

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}  # fmt: skip


def _rate(llm: LLM, batch: int, tokens: int, structured) -> float:
    messages = [[{"role": "user", "content": f"Tell story number {i} as a JSON object."}]
                for i in range(batch)]  # fmt: skip
    params = SamplingParams(
        max_tokens=tokens, temperature=0, ignore_eos=True, structured=structured
    )
    outs = llm.generate(messages, params)
    rates = []
    for out in outs:
        times = out.metrics.token_times
        if len(times) > 1:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.mean(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    llm = LLM(model=args.model, kv_cache_memory="512MiB", kv_host_memory="off",
              kv_disk_path="off", progress=False)  # fmt: skip
    spec = StructuredOutput("json", SCHEMA)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        _rate(llm, batch, 16, None), _rate(llm, batch, 16, spec)  # warm up
        plain, constrained = [], []
        for _ in range(args.rounds):
            plain.append(_rate(llm, batch, args.tokens, None))
            constrained.append(_rate(llm, batch, args.tokens, spec))
        a, b = statistics.median(plain), statistics.median(constrained)
        results[f"batch_{batch}"] = {"unconstrained_tok_s": round(a, 2), "json_schema_tok_s":
                                     round(b, 2), "ratio": round(b / a, 3), "rounds_plain": plain,
                                     "rounds_json": constrained}  # fmt: skip
        print(json.dumps({batch: results[f"batch_{batch}"]}), flush=True)
    llm.close()
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
