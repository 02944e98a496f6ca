"""Time to first token of a request whose system prompt (2,208 tokens) sits under a 5-minute
cache_control breakpoint: created (a fresh prefix) vs read (the same prefix again), 3 fresh
prefixes each, through the engine API with the breakpoint as the Messages route passes it.

    .venv/bin/python scripts/cache_control_ttft.py
"""

import statistics

from kvwise import LLM, SamplingParams
from kvwise.engine.prompts import ChatPrompt
from kvwise.server.cache_usage import anthropic_usage, breakpoints_of

SYSTEM = " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} gate of depot {i} opens at "
    f"{i % 24:02d}:{(7 * i) % 60:02d} and takes parcels under {10 + i % 30} kg."
    for i in range(72)
)
P = SamplingParams(max_tokens=1, temperature=0)
with LLM(kv_host_memory="off", kv_disk_path="off", progress=False) as llm:
    e = llm.engine
    rows = {"created": [], "read": []}
    for rep in range(3):
        system = SYSTEM.replace("Rule", f"Rule{rep}")  # a fresh prefix each rep
        for k, q in enumerate(["When does depot 7 open?", "Which gate of depot 12?"]):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            prefix = e.tokenize(ChatPrompt(msgs[:1], None, False))
            bps = breakpoints_of(e.tokenize(msgs), [(prefix, 300.0)])
            out = llm.chat(msgs, P, cache_breakpoints=bps)[0]
            u = anthropic_usage(out)
            rows["read" if k else "created"].append((out.metrics.ttft, u))
    for kind, r in rows.items():
        print(
            kind,
            "ttft_ms median",
            round(1000 * statistics.median(t for t, _ in r), 1),
            [round(1000 * t) for t, _ in r],
            r[0][1],
        )
