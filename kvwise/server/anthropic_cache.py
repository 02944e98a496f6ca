"""The ``cache_control`` breakpoints of a Messages request (``anthropic_protocol.py``): where
they are, Anthropic's limits on them, and each one's prefix of the conversation.

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) marks a breakpoint on a
tool, a system block or a message's block (a tool_result's text block: the result's own);
the top-level one marks the last block of the last message (an explicit mark there wins). They
are read in prompt order, tools, then system, then messages; at most 4, and a 1h one never
after a 5m one: a 400 otherwise, as Anthropic answers. ``breakpoint_prefixes`` gives each
one's conversation prefix, for the engine's side (``cache_usage.cache_breakpoints``) to count
in tokens. NOTE: kvwise renders the system prompt before the tools (both in the system
message), so a breakpoint on a tool covers the system prompt too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvwise.engine.prompts import ChatPrompt
from kvwise.errors import InvalidRequest

CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}  # cache_control's ttl, in seconds
MAX_CACHE_BREAKPOINTS = 4  # blocks with cache_control in one request (Anthropic's limit)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


@dataclass(frozen=True)
class Mark:
    """A breakpoint: where (``("tools", k)``, ``("system", k)``, ``("messages", i, j)``)."""

    where: tuple
    ttl: str

    @property
    def field(self) -> str:
        if self.where[0] == "messages":
            return f"messages[{self.where[1]}].content[{self.where[2]}]"
        return f"{self.where[0]}[{self.where[1]}]"


def find_marks(tools, system: list, messages: list[list], top: CacheControl | None) -> list[Mark]:
    """The breakpoints of ``tools``, ``system`` blocks and each message's blocks (parsed)
    and the top-level ``top``, in prompt order (a 400 for a 5th, or a 1h after a 5m)."""
    marks = [
        Mark(("tools", k), t.cache_control.ttl) for k, t in enumerate(tools) if t.cache_control
    ]
    marks += [
        Mark(("system", k), b.cache_control.ttl) for k, b in enumerate(system) if b.cache_control
    ]
    for i, blocks in enumerate(messages):
        for j, block in enumerate(blocks):
            control = block.cache_control or _inner_control(block)
            if control is not None:
                marks.append(Mark(("messages", i, j), control.ttl))
    if top is not None and messages[-1]:
        last = ("messages", len(messages) - 1, len(messages[-1]) - 1)
        if not marks or marks[-1].where != last:  # an explicit mark there wins
            marks.append(Mark(last, top.ttl))
    if len(marks) > MAX_CACHE_BREAKPOINTS:
        raise InvalidRequest(
            "cache_control",
            f"a maximum of {MAX_CACHE_BREAKPOINTS} blocks with "
            f"cache_control may be provided, found {len(marks)}",
        )
    for before, after in zip(marks, marks[1:]):
        if CACHE_TTL_S[after.ttl] > CACHE_TTL_S[before.ttl]:
            raise InvalidRequest(
                "cache_control",
                f"a ttl='{after.ttl}' breakpoint ({after.field}) "
                f"may not come after a ttl='{before.ttl}' one ({before.field}): "
                "longer TTLs first",
            )
    return marks


def _inner_control(block: Any) -> CacheControl | None:
    """A tool_result's breakpoint set on a text block of its content (checked already)."""
    content = getattr(block, "content", None) if block.type == "tool_result" else None
    for inner in content if isinstance(content, list) else ():
        if inner.get("cache_control") is not None:
            return CacheControl.model_validate(inner["cache_control"])
    return None


def breakpoint_prefixes(conversation, marks: list[Mark]) -> list[tuple[ChatPrompt, float]]:
    """Each breakpoint, in prompt order: the conversation up to and including the marked
    block (chat messages with the system prompt, and the tools; without the generation
    prompt) and its TTL in seconds (300.0: 5m, 3600.0: 1h). A tool's prefix is the system
    prompt and the tools up to that one (an empty user turn after them where there is no
    system prompt, so that it renders: only what it shares with the prompt counts).
    ``conversation``: the request (``system_messages``, ``engine_messages``,
    ``engine_tools``)."""
    prefixes = []
    tools = conversation.engine_tools()
    for mark in marks:
        kind, k = mark.where[0], mark.where[1]
        if kind == "tools":
            messages = conversation.system_messages() or [{"role": "user", "content": ""}]
            tools_then = tools[: k + 1] if tools else None
        elif kind == "system":
            messages, tools_then = conversation.system_messages(k + 1), tools
        else:
            messages, tools_then = conversation.engine_messages(upto=mark.where[1:]), tools
        prompt = ChatPrompt(messages, tools_then, add_generation_prompt=False)
        prefixes.append((prompt, CACHE_TTL_S[mark.ttl]))
    return prefixes
