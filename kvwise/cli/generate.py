"""``kvwise generate`` (one prompt) and ``kvwise chat`` (a multi-turn chat on the terminal):
the engine's offline API (``kvwise.engine.llm.LLM``), tokens streamed to stdout as they come,
a one-line report on stderr. Flags: their own, the sampling ones, and the engine's (added by
the parser). The engine is imported when a command runs, not when its flags are built."""

from __future__ import annotations

import argparse
import sys

from kvwise.cli.engine_args import engine_config, engine_kwargs


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling_args(p)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    prompt = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = [{"role": "user", "content": args.prompt}]
    _, out = _stream(llm, prompt, params)
    _report(out)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "kvwise chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text, out = _stream(llm, messages, params)
        messages.append({"role": "assistant", "content": text})
        _report(out)


def _sampling(args: argparse.Namespace):
    from kvwise.types import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _make_llm(args: argparse.Namespace):
    from kvwise.engine.llm import LLM

    kwargs = engine_kwargs(args)
    engine_config(kwargs)  # the fast checks, before the model loads
    return LLM(progress=True, **kwargs)


def _stream(llm, prompt, params) -> tuple[str, object]:
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return last.text, last


def _report(out) -> None:
    m = out.metrics
    n = len(out.token_ids)
    decode_time = (m.finished_time or 0) - (m.first_token_time or 0)
    rate = (n - 1) / decode_time if n > 1 and decode_time > 0 else float("nan")
    print(
        f"[{out.num_prompt_tokens} prompt tokens ({out.num_cached_tokens} cached), {n} generated, "
        f"TTFT {m.ttft * 1000:.0f} ms, {rate:.1f} tokens/s, finish: {out.finish_reason.value}, "
        f"K/V rows projected: {out.num_kv_rows_projected}]",
        file=sys.stderr,
    )
