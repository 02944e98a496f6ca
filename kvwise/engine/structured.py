"""Structured outputs: llguidance grammars per request, their token masks each step. No torch.

``GrammarCompiler(tokenizer, vocab_size)`` compiles a ``StructuredOutput`` (JSON schema, regex,
Lark grammar, choice) into a ``Grammar``: an ``llguidance.LLMatcher`` over the model's own
vocabulary (its ``tokenizers`` JSON, built once, lazily: ~1 s at a 262k vocabulary). Compiling
is bounded: the constraint's text by ``MAX_GRAMMAR_CHARS`` (``types.py``), the work by
llguidance's parser limits (lexer fuel, Earley items, grammar size), and it runs where the
prompt is tokenized (``AsyncEngine``'s tokenizer threads), never in the step loop. A schema or
grammar llguidance refuses is an ``InvalidRequest`` naming the request's field.

Each step the engine asks every sampling request's grammar for its mask (``bitmask``: 32-bit
words, bit i of word w allowing token 32 w + i; ~50 µs at a 128k vocabulary), the worker
masks the logits with it, and the sampled token is fed back (``accept``). A grammar that is
complete (``finished``) ends its request with ``stop``. llguidance allows EOS where the grammar
may end, so a model that stops there stops as usual.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from kvwise.errors import InvalidRequest
from kvwise.types import StructuredOutput

# bounds on one grammar's work (llguidance's own defaults are 1M / 200k / 50k / 500k)
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
               max_grammar_size=200_000)  # fmt: skip


def grammar_text(spec: StructuredOutput) -> str:
    """The constraint as an llguidance grammar (its JSON form or Lark)."""
    import llguidance

    if spec.kind == "json":
        schema = spec.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(spec.field, f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(spec.field, "the schema must be a JSON object")
        # no free whitespace: a small model would otherwise pad the object with newlines
        options = {"whitespace_flexible": False}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise InvalidRequest(spec.field, f"invalid JSON schema: {exc}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)  # type: ignore[arg-type]
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)  # type: ignore[arg-type]
    alternatives = " | ".join(json.dumps(c) for c in spec.value)  # type: ignore[union-attr]
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


class Grammar:
    """One request's matcher: the mask of what may come next, fed each sampled token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def bitmask(self) -> bytes:
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        """Feed a sampled token; False if the grammar did not allow it (or is in error)."""
        return bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()

    @property
    def finished(self) -> bool:
        """Nothing more may follow (the output is complete)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles requests' constraints over one model's vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._backend = tokenizer  # a kvwise Tokenizer: its tokenizers backend and EOS ids
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                eos = sorted(self._backend.eos_token_ids)
                if not eos:
                    raise InvalidRequest("response_format", "the model has no EOS token")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._backend.backend_json(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for one request (InvalidRequest naming ``spec.field``)."""
        import llguidance

        text = grammar_text(spec)
        tokenizer = self._tokenizer()
        limits = llguidance.LLParserLimits(**_LIMITS)
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
        if error:
            raise InvalidRequest(spec.field, f"invalid {spec.kind}: {error[:500]}")
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequest(spec.field, f"invalid {spec.kind}: {matcher.get_error()[:500]}")
        # NOTE: a constraint that admits no first token (``{"$ref": "#"}``, $refs that only
        # refer to each other) compiles, then puts the matcher in error at its first mask;
        # asked here once (one mask's work, ~50 µs at a 128k vocabulary), it is a 400, not an
        # empty 200
        matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidRequest(spec.field, f"the {spec.kind} admits no value")
        return Grammar(matcher)
