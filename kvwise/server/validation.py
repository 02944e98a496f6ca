"""Checks on a request body that pydantic's types do not make: text that is no Unicode (in a
value or a key, at any depth), ``logit_bias`` keys, and the tools' definitions. Each failure is
an ``InvalidRequest`` naming the field, so the client gets a 400, never a 500.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from kvwise.errors import InvalidRequest
from kvwise.server.outputs import Tool

# a token id as logit_bias spells it: ASCII decimal digits only ("²" and "٣" are digits to
# str.isdigit but not token ids), at most 10 of them (past that int() is slow or refuses)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def check_unicode(body: BaseModel, raw: bytes) -> None:
    """Refuse text that is no Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can
    escape), in a value or in an object's key (a tool's property name, a schema's key, a
    ``logit_bias`` key): it could reach neither a tokenizer nor an error message. ``raw``: the
    body's bytes; one without a surrogate's escape or UTF-8 form holds none, and is not walked
    (a walk of a million token ids would hold the event loop for a third of a second).

    Raises:
        InvalidRequest: naming the first such field (``messages[0].content``; for a key, the
            object holding it: ``tools[0].function.parameters.properties``).
    """
    if not _SURROGATE.search(raw):
        return
    found = _invalid_text(body.model_dump(exclude_none=True), "")
    if found is not None:
        param, what = found
        raise InvalidRequest(param, f"{what} is not valid Unicode (it holds a lone surrogate)")


# where a surrogate can come from: JSON's \uD800-\uDFFF escapes, or their UTF-8 bytes
# (json.loads decodes bytes with surrogatepass)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_text(value: Any, path: str) -> tuple[str, str] | None:
    """(the field, "the text" or "a key") of the first text that is no Unicode, or None."""
    if isinstance(value, str):
        return None if _is_unicode(value) else (path or "body", "the text")
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and not _is_unicode(key):
                return path or "body", "a key"
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        texts = (str, dict, list, tuple)
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, texts))
    else:
        return None
    for child_path, child in items:
        found = _invalid_text(child, child_path)
        if found is not None:
            return found
    return None


def logit_bias_pairs(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; a key that is not a token id in ASCII decimal
    digits is an ``InvalidRequest`` (ids past the vocabulary: the engine's check)."""
    pairs = []
    for key, bias in (logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequest(
                "logit_bias", f"keys are token ids (0-9, at most 10 digits), got {ascii(key)[:40]}"
            )
        pairs.append((int(key), bias))
    return tuple(pairs)


def check_tools(tools: list[Tool] | None) -> None:
    """Each function named once; its ``parameters`` (when given and not ``{}``) a JSON Schema
    with ``"type": "object"``, as OpenAI requires (a call's arguments are an object; a schema
    such as ``{"$ref": "#"}`` is refused here, not left to admit no call)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if name in seen:
            raise InvalidRequest("tools", f"function names must be unique, {name!r} is repeated")
        seen.add(name)
        schema = tool.function.parameters
        kind = schema.get("type") if schema else "object"  # none or {}: no arguments
        if kind != "object":
            raise InvalidRequest(
                f"tools[{i}].function.parameters",
                f'must be a JSON Schema of "type": "object", got "type": {ascii(kind)[:40]}',
            )
