"""Incremental detokenizer and stop strings, on the default model's tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise.engine.detokenize import IncrementalDetokenizer, StopCheck, StopStringMatcher
from kvwise.engine.tokenizer import Tokenizer
from tests.unit.test_tokenizer import TEXTS

# ---- incremental detokenizer -----------------------------------------------------------------


def _stream(tok, ids, skip_special_tokens=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, detok.text


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streams_real_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, streamed = _stream(tok, ids, skip_special_tokens=False)
    assert streamed == text
    assert not any("\ufffd" in d for d in deltas)
    assert _stream(tok, ids)[1] == tok.decode(ids)


def test_detokenizer_holds_split_emoji(tok: Tokenizer) -> None:
    # A character the vocabulary has no token for is spelled in byte pieces.
    assert len(tok.encode("🦜")) > 1
    ids = tok.encode("x🦜y")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == "x🦜y"
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back while the parrot's bytes were incomplete


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_detokenizer_equals_full_decode(tok: Tokenizer, data) -> None:
    # Mix arbitrary ids with byte-fragment ids (the ones that split characters) and specials.
    fragment_ids = _fragment_ids(tok)
    id_strategy = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(fragment_ids),
        st.sampled_from(sorted(tok.special_token_ids)),
    )
    ids = data.draw(st.lists(id_strategy, max_size=40))
    skip = data.draw(st.booleans())
    deltas, streamed = _stream(tok, ids, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert streamed == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_detokenizer_round_trips_any_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, streamed = _stream(tok, ids, skip_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=False)
    assert streamed == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_bounded_window_on_invalid_bytes(tok: Tokenizer) -> None:
    # Lone continuation bytes: every window ends in U+FFFD, yet text must flow and the window
    # of ids kept must stay bounded.
    frag = [i for i in _fragment_ids(tok) if tok.decode([i]) == "\ufffd"]
    rng = random.Random(0)
    ids = [rng.choice(frag) for _ in range(300)]
    detok = IncrementalDetokenizer(tok)
    deltas, window_sizes = [], []
    for i in ids:
        deltas.append(detok.add(i))
        window_sizes.append(len(detok._ids))
    assert sum(map(len, deltas)) > 0
    assert max(window_sizes) <= 2 * (16 + 4)  # context chunk + pending ids
    assert detok.text + detok.flush() == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_detokenizer_exact_on_long_fragment_runs(tok: Tokenizer, data) -> None:
    # Long runs of byte pieces force the bounded-window path; the output must stay exact.
    ids = data.draw(st.lists(st.sampled_from(_fragment_ids(tok)), min_size=10, max_size=80))
    deltas, streamed = _stream(tok, ids)
    assert streamed == tok.decode(ids)


def _fragment_ids(tok: Tokenizer) -> list[int]:
    """Ids whose text alone is not valid UTF-8 (pieces of multi-byte characters)."""
    cache = getattr(tok, "_test_fragment_ids", None)
    if cache is None:
        cache = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
        tok._test_fragment_ids = cache
    return cache


# ---- stop strings ----------------------------------------------------------------------------


def _run_stop(stop, deltas) -> tuple[str, bool]:
    matcher = StopStringMatcher(stop)
    out = []
    for d in deltas:
        check = matcher.feed(d)
        out.append(check.text)
        if check.stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_across_deltas() -> None:
    assert _run_stop(["STOP"], ["Hello S", "T", "OP more"]) == ("Hello ", True)
    assert _run_stop(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_stop_holds_partial_then_releases() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello ST") == StopCheck("Hello ", False)
    assert m.feed("O") == StopCheck("", False)
    assert m.feed("P!") == StopCheck("", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello ST") == StopCheck("Hello ", False)
    assert m.feed("OW") == StopCheck("STOW", False)
    assert m.feed("S") == StopCheck("", False)
    assert m.flush() == "S"


def test_stop_multiple_strings_earliest_wins() -> None:
    assert _run_stop(["world", "lo"], ["hello world"]) == ("hel", True)
    assert _run_stop(["<end>", "</s>"], ["a</", "s>b"]) == ("a", True)
    assert _run_stop(["abc", "bcd"], ["xab", "cd"]) == ("x", True)
    assert _run_stop(["xyz"], ["no match here"]) == ("no match here", False)
    m = StopStringMatcher(["zz", "abc", "ab"])
    assert m.feed("a") == StopCheck("", False) and m.matched is None
    assert m.feed("bc") == StopCheck("", True)
    assert m.matched == "abc"  # of those starting earliest, the first listed
    assert m.feed("more") == StopCheck("", True)


def test_stop_no_strings_passes_through() -> None:
    assert _run_stop([], ["a", "b"]) == ("ab", False)


@pytest.mark.parametrize("stop", [[""], ["ok", ""], "STOP", [3]])
def test_stop_rejects_bad_input(stop) -> None:
    with pytest.raises(ValueError, match="^stop: "):
        StopStringMatcher(stop)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_any_split_equals_whole(text, stop, cuts) -> None:
    """Held back at most max(len)-1 chars; result equals truncating the whole text."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stop)
    max_held = max((len(s) for s in stop), default=1) - 1
    out, stopped, seen = [], False, 0
    for d in deltas:
        check = matcher.feed(d)
        out.append(check.text)
        seen += len(d)
        if check.stopped:
            stopped = True
            break
        assert seen - len("".join(out)) <= max_held
    if not stopped:
        out.append(matcher.flush())
    got = "".join(out)
    hits = [text.find(s) for s in stop if s in text]
    if not hits:
        assert (got, stopped) == (text, False)
    else:
        # The first stop string to be complete ends the stream; it is at or after the earliest one.
        assert stopped
        assert text.startswith(got)
        assert any(text[len(got) :].startswith(s) for s in stop)
