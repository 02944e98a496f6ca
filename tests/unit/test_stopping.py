"""One owner for when a request ends (issue 47, item 2): ``core/stopping.stop_reason``, called
once per sampled token from ``Scheduler.update``, with the request's limits first and then the
parts the engine attached (its grammar, its text and stop strings). A stop string now ends a
request inside the step that sampled it, in the scheduler, as EOS does: no second place
finishes it afterwards."""

from __future__ import annotations

import dataclasses

from kvwise.core.request import Request
from kvwise.core.stopping import limit_reason, stop_reason
from kvwise.engine.stop_parts import GrammarStop, TextStop
from kvwise.types import FinishReason, SamplingParams
from tests.fakes import EOS, ByteTokenizer, fake_engine


class Part:
    """A stop part that records what it saw and ends the request at ``end_at`` (a token)."""

    what = "the toy part"

    def __init__(self, end_at: int | None = None, raise_at: int | None = None) -> None:
        self.seen: list[int] = []
        self.end_at, self.raise_at = end_at, raise_at

    def check(self, token_id: int) -> FinishReason | None:
        self.seen.append(token_id)
        if token_id == self.raise_at:
            raise RuntimeError("it broke")
        return FinishReason.STOP if token_id == self.end_at else None


def _request(max_tokens: int = 4, **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return Request("r", [1, 2, 3], sampling, eos_token_ids=frozenset({EOS}))


def _feed(request: Request, token_id: int) -> FinishReason | None:
    request.append_token(token_id, 0.0)
    return stop_reason(request, token_id)


def test_the_limits_come_first_and_every_part_sees_every_token():
    request = _request(max_tokens=2)
    first, second = Part(end_at=7), Part()
    request.stop_parts = [first, second]
    assert _feed(request, 5) is None
    # token 7 ends it by max_tokens (the limit names the reason) and by the first part
    assert _feed(request, 7) is FinishReason.LENGTH
    assert first.seen == second.seen == [5, 7]
    request = _request()
    request.stop_parts = [Part(end_at=9), Part(end_at=9)]
    assert _feed(request, 9) is FinishReason.STOP


def test_eos_and_stop_ids_unless_ignored():
    assert limit_reason(_feed_only(_request(), EOS), EOS) is FinishReason.STOP
    assert limit_reason(_feed_only(_request(ignore_eos=True), EOS), EOS) is None
    request = _request(stop_token_ids=[42])
    assert _feed(request, 42) is FinishReason.STOP


def _feed_only(request: Request, token_id: int) -> Request:
    request.append_token(token_id, 0.0)
    return request


def test_a_part_that_raises_ends_its_request_alone_with_why():
    request = _request()
    later = Part()
    request.stop_parts = [Part(raise_at=6), later]
    assert _feed(request, 6) is FinishReason.ERROR
    assert request.error == "the toy part failed: it broke"


class Grammar:
    def __init__(self, complete_at: int) -> None:
        self.complete_at, self.finished = complete_at, False

    def accept(self, token_id: int) -> bool:
        self.finished = token_id == self.complete_at
        return token_id != 0  # 0: refused


def test_the_grammar_part_ends_on_completion_or_refusal():
    part = GrammarStop(Grammar(complete_at=9))
    assert [part.check(t) for t in (4, 9)] == [None, FinishReason.STOP]
    assert GrammarStop(Grammar(complete_at=9)).check(0) is FinishReason.STOP


def test_the_text_part_holds_back_a_possible_stop_string_and_releases_it_at_the_end():
    text = TextStop(ByteTokenizer(), ["END"])
    assert [text.check(t) for t in b"ab E"] == [None] * 4
    assert text.take() == "ab "  # "E" may begin "END"
    assert text.take(ended=True) == "E"  # the request ended otherwise: released
    text = TextStop(ByteTokenizer(), ["END"])
    assert [text.check(t) for t in b"xEND"][-1] is FinishReason.STOP
    assert text.take(ended=True) == "x" and text.matched == "END"


def _run(engine, prompt: str, params: SamplingParams):
    request_id = engine.add_request(prompt, params)
    request = engine.scheduler.requests[request_id]
    outs = []
    while engine.has_unfinished():
        step = [o for o in engine.step() if o.request_id == request_id]
        outs += step
        if step and step[-1].finished:  # ended in the step that sampled its last token
            assert request_id not in engine.scheduler.requests
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    return request, outs[-1]


def test_a_stop_string_ends_the_request_where_it_begins():
    engine = fake_engine(num_blocks=64)
    prompt = "hello world, " * 3
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    _, free = _run(engine, prompt, params)
    assert free.finish_reason is FinishReason.LENGTH and free.stop_string is None
    stop = free.text[len(free.text) // 2 :][:2]  # two characters from its second half
    request, last = _run(engine, prompt, dataclasses.replace(params, stop=[stop]))
    assert last.finish_reason is FinishReason.STOP and last.stop_string == stop
    assert last.text == free.text[: free.text.find(stop)]
    assert len(last.token_ids) < 40 and last.token_ids == free.token_ids[: len(last.token_ids)]
    assert isinstance(request.stop_parts[-1], TextStop) and request.error is None
