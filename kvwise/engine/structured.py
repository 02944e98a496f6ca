"""Structured outputs: llguidance grammars per request, their token masks each step. No torch.

A ``StructuredOutput`` (JSON schema, regex, Lark grammar, choice) becomes llguidance's grammar
text here (``grammar_text``) and a ``Grammar``, an ``llguidance.LLMatcher`` over the model's own
vocabulary, in ``grammar_compiler.py`` (a deadline, a cache, slots per tenant), never in the
step loop. The constraint's text is bounded by ``MAX_GRAMMAR_CHARS`` (``types.py``), its
parsing work by ``PARSER_LIMITS``. A schema or grammar llguidance refuses is an
``InvalidRequest`` naming the request's field.

JSON schemas are strict by default, as OpenAI's strict mode (and xgrammar's): every object
schema that names its ``properties`` and says nothing of other keys (no
``additionalProperties`` / ``unevaluatedProperties``) admits no others (``close_objects``),
and no whitespace is free (one spelling: ``,`` and ``:`` here, ``, `` and ``: `` in tool
calls), so a small model cannot wander off inside an object: a key the schema never named
(``"unit_map_map_map…"``) is not in the grammar. An object naming no properties
(``{"type": "object"}``, json_object mode) stays any object. A request opts out where its
API lets it (``strict: false``) by ``open_objects``: the schema then says so explicitly.

Each step the engine asks every sampling request's grammar for its mask (``bitmask``: 32-bit
words, bit i of word w allowing token 32 w + i; ~50 µs at a 128k vocabulary), the worker
masks the logits with it, and the sampled token is fed back (``accept``). A grammar that is
complete (``finished``) ends its request with ``stop``. llguidance allows EOS where the grammar
may end, so a model that stops there stops as usual.
"""

from __future__ import annotations

import json
from typing import Any

from kvwise.errors import InvalidRequest
from kvwise.types import StructuredOutput

# bounds on one grammar's parsing work (llguidance's own defaults are 1M / 200k / 50k / 500k);
# its lexer's construction has no such bound: ``grammar_workers.py`` bounds that by a deadline
PARSER_LIMITS = {
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_grammar_size": 200_000,
}


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA_KEYS = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "propertyNames",
)
_LIST_KEYS = ("anyOf", "oneOf", "prefixItems", "items")
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# an object schema with one of these says what else it admits, or is composed with others
_OPEN_KEYS = (
    "additionalProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
)


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` whose object schemas that name ``properties`` and say nothing of
    other keys admit none (``additionalProperties: false``), at every depth ($defs too;
    ``_closable`` says which)."""
    return _default_additional(schema, False)


def open_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` saying explicitly what JSON Schema leaves implicit: its object
    schemas that name ``properties`` admit other keys (a request's ``strict: false``)."""
    return _default_additional(schema, True)


def _default_additional(schema: dict[str, Any], allowed: bool) -> dict[str, Any]:
    # NOTE: a walk with its own stack, not recursion: a schema nested 10k deep is bounded by
    # its size alone; the copy (json's, in C) is what ``StructuredOutput.text`` does already
    schema = json.loads(json.dumps(schema))
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (node, a direct member of an allOf)
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue
        if _closable(node) and not in_all_of:
            node["additionalProperties"] = allowed
        for key in _SCHEMA_KEYS:
            if isinstance(node.get(key), dict):
                stack.append((node[key], False))
        for key in _LIST_KEYS:
            if isinstance(node.get(key), list):
                stack.extend((item, False) for item in node[key])
        if isinstance(node.get("allOf"), list):
            stack.extend((item, True) for item in node["allOf"])
        for key in _MAP_KEYS:
            if isinstance(node.get(key), dict):
                stack.extend((item, False) for item in node[key].values())
    return schema


def _closable(node: dict[str, Any]) -> bool:
    """An object schema naming its properties, silent on other keys, requiring none but its
    own. NOTE: neither an object composed with others (an allOf member, one beside a
    combinator or a $ref: closing one part would refuse the other parts' keys) nor one
    requiring a key it does not name (closed, it would admit nothing) is closed."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or any(key in node for key in _OPEN_KEYS):
        return False
    required = node.get("required", [])
    return isinstance(required, list) and all(name in properties for name in required)


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
        schema = close_objects(schema)
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


def first_mask_error(matcher: Any, kind: str) -> str | None:
    """None if the compiled ``matcher`` admits a first token, else the error to answer.

    A constraint that admits no first token (``{"$ref": "#"}``, $refs that only refer to each
    other) compiles, then puts the matcher in error at its first mask; asked once here (one
    mask's work, ~50 µs at a 128k vocabulary), it is a 400, not an empty 200. The mask leaves
    the matcher where it was."""
    matcher.compute_bitmask()
    if matcher.is_error():
        return f"the {kind} admits no value"
    return None


def parser_limits() -> Any:
    """The bounds on one grammar's parsing work, as llguidance takes them."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)
