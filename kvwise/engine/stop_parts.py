"""The parts of a request's stop policy that need the engine's objects (``core/stopping.py``
decides, once per sampled token, in the order it documents): ``GrammarStop`` (a compiled
grammar: a structured output's or a tool call's) and ``TextStop`` (the request's text and its
stop strings). No torch.

``TextStop`` is also where a request's text is made: it decodes each token as the policy hands
it over (``IncrementalDetokenizer``) and holds back what may still begin a stop string
(``StopStringMatcher``); the ``OutputProcessor`` takes the text made since its last output
(``take``), the tail released when the request ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwise.engine.detokenize import Decoder, IncrementalDetokenizer, StopStringMatcher
from kvwise.types import FinishReason


class GrammarStop:
    """Ends the request when its grammar is complete or refuses the token (a structured
    output whose value is written, a tool call whose arguments are closed)."""

    what = "the grammar"

    def __init__(self, grammar) -> None:
        self.grammar = grammar  # engine/structured.Grammar: accept(token), finished

    def check(self, token_id: int) -> FinishReason | None:
        accepted = self.grammar.accept(token_id)
        return FinishReason.STOP if self.grammar.finished or not accepted else None


class TextStop:
    """A request's text, token by token, and its stop strings (none: the text alone)."""

    what = "detokenizing"

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stop) if stop else None
        self._pending = ""  # made and not taken yet
        self._ended = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.matcher.matched if self.matcher is not None else None

    def check(self, token_id: int) -> FinishReason | None:
        return FinishReason.STOP if self._feed(self.detokenizer.add(token_id)) else None

    def take(self, ended: bool = False) -> str:
        """The text made since the last call; ``ended``: the request is over, so with the
        detokenizer's tail and the text held back for a stop string that never came."""
        if ended and not self._ended:
            self._ended = True
            if not self._feed(self.detokenizer.flush()) and self.matcher is not None:
                self._pending += self.matcher.flush()
        text, self._pending = self._pending, ""
        return text

    def _feed(self, delta: str) -> bool:
        """Add decoded text; True once a stop string has matched (the text ends before it)."""
        if self.matcher is None:
            self._pending += delta
            return False
        found = self.matcher.feed(delta)
        self._pending += found.text
        return found.stopped
