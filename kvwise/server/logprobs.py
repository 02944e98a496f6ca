"""Logprobs as OpenAI writes them, from a ``RequestOutput``'s ids, logprobs and token texts:
chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and completions' ``{tokens,
token_logprobs, top_logprobs, text_offset}`` (with ``echo``, the prompt's tokens first, the
first one's logprob null)."""

from __future__ import annotations

from kvwise.server.outputs import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from kvwise.types import RequestOutput


def _text(out: RequestOutput, token_id: int) -> str:
    return (out.token_texts or {}).get(token_id, "")


def chat_logprobs(out: RequestOutput, start: int, end: int) -> ChatLogprobs | None:
    """Output tokens ``start .. end - 1`` (a stream's delta, or all of them)."""
    if out.top_logprobs is None:
        return None
    content = []
    for i in range(start, end):
        token = _text(out, out.token_ids[i])
        tops = [
            TopLogprob(token=_text(out, t), logprob=lp, bytes=list(_text(out, t).encode()))
            for t, lp in out.top_logprobs[i]
        ]
        content.append(
            TokenLogprob(
                token=token, logprob=out.logprobs[i], bytes=list(token.encode()), top_logprobs=tops
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    out: RequestOutput, echo: bool, num_outputs: int, text_start: int = 0
) -> CompletionLogprobs | None:
    """The first ``num_outputs`` output tokens, after the prompt's with ``echo``;
    ``text_start``: the first token's offset in the choice's text."""
    if out.top_logprobs is None and not (echo and out.prompt_logprobs):
        return None
    tokens, logprobs, tops = [], [], []
    if echo and out.prompt_logprobs is not None:
        for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            tokens.append(_text(out, token_id))
            logprobs.append(None if entry is None else entry[0])
            tops.append(None if entry is None else _top_dict(out, entry[1]))
    for i in range(num_outputs):
        tokens.append(_text(out, out.token_ids[i]))
        logprobs.append(out.logprobs[i])
        tops.append(_top_dict(out, out.top_logprobs[i]) if out.top_logprobs else None)
    offsets, at = [], text_start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
    )


def _top_dict(out: RequestOutput, top: list[tuple[int, float]]) -> dict[str, float]:
    found: dict[str, float] = {}
    for token_id, logprob in top:
        found.setdefault(_text(out, token_id), logprob)  # two ids of one text: the likelier
    return found


def prompt_text(out: RequestOutput) -> str:
    """The prompt as its tokens' texts (echo of a prompt given as token ids)."""
    return "".join(_text(out, t) for t in out.prompt_token_ids)
