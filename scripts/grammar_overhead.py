"""Decode speed under a JSON schema vs unconstrained, same engine, rounds interleaved.

  python scripts/grammar_overhead.py [--model M] [--batches 1,16] [--rounds 5] [--tokens 128]
      [--json OUT]
  python scripts/grammar_overhead.py --masks [--rounds 20] [--json OUT]

``--masks``: no model, its vocabulary only: the compile time (llguidance's ``LLMatcher`` over the
vocabulary, median of ``rounds``) and the time of one token's mask (median and p90 over every
token of a valid answer, fed as the engine feeds them, ``rounds`` times) of a forced tool call (issue 46's
``get_weather``: ``server.tools.call_grammar``) and of a json_schema, each built by the code on
``PYTHONPATH`` (run it once on each tree to compare grammars).

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


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Perth", '
    '"unit": "celsius"}}\n</tool_call>'
)


def _grammar_times(tokenizer, tok, text: str, answer: str, rounds: int) -> dict:
    import time

    import llguidance

    from kvwise.engine.structured import parser_limits

    compiles, masks = [], []
    token_ids = tok.encode(answer, add_special_tokens=False)
    for _ in range(rounds):  # each round: a compile, then the answer's masks on it
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        compiles.append(time.perf_counter() - t0)
        for token_id in token_ids:
            t0 = time.perf_counter()
            matcher.compute_bitmask()
            masks.append(time.perf_counter() - t0)
            assert matcher.consume_token(token_id), "the answer does not fit the grammar"
    masks.sort()
    return {
        "compile_ms": round(1e3 * statistics.median(compiles), 2),
        "mask_us_median": round(1e6 * statistics.median(masks), 1),
        "mask_us_p90": round(1e6 * masks[int(0.9 * (len(masks) - 1))], 1),
        "tokens": len(token_ids),
        "grammar_chars": len(text),
    }


def masks(model: str | None, rounds: int) -> dict:
    """Compile and per-token mask times of the tool-call and json_schema grammars."""
    import llguidance

    from kvwise.engine.structured import grammar_text
    from kvwise.engine.tokenizer import Tokenizer
    from kvwise.models.default import default_model_path
    from kvwise.server.outputs import FunctionDef
    from kvwise.server.tools import call_grammar

    tok = Tokenizer.from_path(model or default_model_path())
    tokenizer = llguidance.LLTokenizer(
        tok.backend_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
    )
    tool = call_grammar([FunctionDef(name="get_weather", parameters=WEATHER)], None, True)
    specs = {
        "tool_call": (StructuredOutput("grammar", tool), CALL),
        "json_schema": (StructuredOutput("json", WEATHER), '{"city":"Perth","unit":"celsius"}'),
    }
    return {
        name: _grammar_times(tokenizer, tok, grammar_text(spec), answer, rounds)
        for name, (spec, answer) in specs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--masks", action="store_true", help="compile and mask times, no model run")
    args = p.parse_args()
    if args.masks:
        results = masks(args.model, args.rounds)
        print(json.dumps(results, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
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
