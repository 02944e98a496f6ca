"""Chat templates: the jinja2 sandbox transformers renders them in, message checks, and a
template given by the user (``load_chat_template``: ``--chat-template``).

A template is compiled once per tokenizer in the same environment transformers uses
(trim_blocks, lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``
and a hardened ``namespace``), so rendered prompts are identical to transformers'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvwise.errors import ContextLengthExceeded, InvalidRequest

# NOTE: a chat request's cost before it is refused must not grow with its body: the messages
# are counted before anything is rendered, and the rendering measured before it is tokenized
MAX_MESSAGES = 2048  # messages in one chat prompt


def pick_template(template: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or ``[{"name", "template"}, ...]``."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    return template if isinstance(template, str) else None


def check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages", "expected a non-empty list of {role, content} dicts")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(
            "messages", f"at most {MAX_MESSAGES} messages in one request, got {len(messages)}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest("messages", f"item {i} is {type(message).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequest("messages", f"item {i} needs a str {key!r}")


def check_rendered_length(text: str, max_chars: int | None) -> None:
    """Refuse a rendered chat longer than ``max_chars`` before it is tokenized."""
    if max_chars is not None and len(text) > max_chars:
        raise ContextLengthExceeded(
            "messages",
            f"the rendered chat has {len(text)} characters, more than the model's context "
            f"can hold ({max_chars})",
        )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` refusing underscore names, hardened as transformers does it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` in args
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (same environment and helpers)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"chat_template: not valid Jinja: {exc.message} (line {exc.lineno})"
        ) from exc


def load_chat_template(template: str) -> str:
    """The Jinja source ``chat_template`` names: the text itself when it holds ``{%`` or
    ``{{``, else the file at that path. Compiled here, so that a bad one fails at start.

    Raises:
        ValueError: naming ``chat_template``: no such file, unreadable, or not valid Jinja.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat_template: expected a file's path or a template, got {template!r}")
    source = template
    if "{%" not in template and "{{" not in template:
        try:
            with open(os.path.expanduser(template), encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ValueError(f"chat_template: cannot read '{template}': {why}") from None
    compile_template(source)
    return source


TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions you "
    "may call are described within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call "
    "a function, answer with a JSON object of its name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


def tool_call_text(call: Mapping[str, Any]) -> str:
    """One call (OpenAI's ``{"function": {"name", "arguments"}}``) as Hermes writes it."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    # name first, json.dumps' separators: as a required call's grammar writes it
    # (server/tools.call_grammar), so that the next turn's prompt repeats the answer's text
    # and hits its cached blocks
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_tools(messages: Sequence[Mapping[str, Any]], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools described in the system
    message (Hermes' wording, as Qwen 2.5 and SmolLM3 ship it), assistant calls written as
    ``<tool_call>`` text and tool results as ``<tool_response>`` in a user turn."""
    out: list[dict] = []
    for message in messages:
        m = dict(message)
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c) for c in m.pop("tool_calls"))
            m["content"] = f"{content}\n{calls}" if content else calls
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        else:
            m["content"] = content
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=described)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
