"""The tokenizer layer: text <-> token ids, and chat templates. No torch here.

Contract:
- `encode` reads special tokens written in the text (``"<|im_start|>"`` becomes one id), as
  transformers and llama.cpp do, and adds BOS only when the model asks for it.
- `decode` drops special tokens by default and applies no "clean up" of spaces.
- `apply_chat_template` renders the model's Jinja template in an immutable sandbox set up the way
  transformers sets it up, so a prompt renders byte for byte as the reference renders it.
- `eos_token_ids` is every id that ends a generation: EOS plus the extra ids that
  generation_config.json (or a GGUF's end-of-turn keys) lists.

Sources, picked by `Tokenizer.from_path`:
- a Hugging Face model directory: tokenizer.json, tokenizer_config.json, generation_config.json
  and an optional chat_template.jinja;
- a GGUF file: a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) or SentencePiece (``"llama"``)
  vocabulary. A GGUF has no tokenizer.json, so the tokenizer is rebuilt from the vocabulary by
  `kvwise.engine.gguf_tokenizer` (as transformers rebuilds it from the same file).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as Backend

from kvwise.engine.chat_template import (
    check_messages,
    check_rendered_length,
    compile_template,
    pick_template,
    with_tools,
)
from kvwise.engine.gguf_tokenizer import read_gguf_tokenizer
from kvwise.errors import InvalidRequest


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model facts around it (BOS/EOS, chat template).

    Args:
        backend: the text <-> ids model; special tokens must be added to it as special tokens.
        bos_token_id: the model's BOS id, or None.
        eos_token_id: the model's EOS id, or None; also the template's ``eos_token``.
        extra_eos_token_ids: more ids that end a generation (e.g. end-of-turn).
        add_bos_token: whether `encode(..., add_special_tokens=True)` prepends BOS.
        chat_template: Jinja source of the chat template, or None.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        extra = frozenset(extra_eos_token_ids)
        for name, ids in (
            ("bos_token_id", {bos_token_id} - {None}),
            ("eos_token_id", {eos_token_id} - {None}),
            ("extra_eos_token_ids", extra),
        ):
            if any(not 0 <= i < vocab_size for i in ids):
                raise ValueError(f"{name}: {sorted(ids)} not in the vocabulary of {vocab_size}")
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token: the model asks for BOS but names no bos_token_id")
        self._vocab_size = vocab_size
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._eos_token_ids = extra | ({eos_token_id} - {None})
        self._add_bos_token = add_bos_token
        self._special_token_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory or a ``.gguf`` file.

        Raises:
            ValueError: the path is neither, or holds a tokenizer this module cannot build.
        """
        path = Path(path)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise ValueError(f"path: {path} is a directory without tokenizer.json")
            return cls.from_hf_dir(path)
        if path.suffix == ".gguf" and path.is_file():
            return cls.from_gguf(path)
        raise ValueError(f"path: {path} is neither a model directory nor a .gguf file")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json from `path`.

        BOS is added by tokenizer.json's post-processor, or by us when the config sets
        ``add_bos_token``; the chat template comes from chat_template.jinja if present, else
        from tokenizer_config.json (a string, or a list of named templates: "default" is used).
        """
        path = Path(path)
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, Mapping):  # a serialized AddedToken
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        extra_eos = generation.get("eos_token_id")
        extra_eos = [extra_eos] if isinstance(extra_eos, int) else list(extra_eos or ())
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = pick_template(config.get("chat_template"))
        bos_token_id = token_id("bos_token")
        if bos_token_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_token_id = generation["bos_token_id"]
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=token_id("eos_token"),
            extra_eos_token_ids=extra_eos,
            add_bos_token=bool(config.get("add_bos_token", False)) and bos_token_id is not None,
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, source: str | Path | Any) -> Tokenizer:
        """Build the tokenizer a GGUF file describes.

        Args:
            source: a path (opened with kvwise's own reader, ``models/gguf_file.py``: ms), or
                an open `gguf.GGUFReader` (a caller that also loads weights shares the one it
                opened). Building Gemma's SentencePiece backend takes ~4 s.
        """
        import gguf

        from kvwise.models.gguf_file import GGUFFile

        reader = source if isinstance(source, gguf.GGUFReader) else GGUFFile(source)
        spec = read_gguf_tokenizer(reader)
        return cls(
            spec.backend,
            bos_token_id=spec.bos_token_id,
            eos_token_id=spec.eos_token_id,
            extra_eos_token_ids=spec.extra_eos_token_ids,
            add_bos_token=spec.add_bos_token,
            chat_template=spec.chat_template,
        )

    # ---- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS id (the template's ``eos_token``)."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_token_ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary entry's length
        (a byte-level entry has one symbol per byte, and a character takes at least one)."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def set_chat_template(self, source: str) -> None:
        """Render chats with ``source`` (Jinja) instead of the model's own template (or where
        it has none): ``--chat-template``. ValueError naming ``chat_template`` if not Jinja."""
        self._compiled_template = compile_template(source)
        self._chat_template = source

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their ids.

        With `add_special_tokens`, the backend's post-processor runs and BOS is prepended when
        the model asks for it (and is not there already).
        """
        if not isinstance(text, str):
            raise InvalidRequest("text", f"expected str, got {type(text).__name__}")
        # NOTE: encode_batch releases the GIL while it runs (encode does not): a huge prompt
        # tokenized on the engine thread does not stall the server's event loop
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._add_bos_token and ids[:1] != [self._bos_token_id]:
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Bytes that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The ``tokenizers`` model as JSON (what llguidance builds its vocabulary from)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling for BPE), or None."""
        return self._backend.id_to_token(token_id)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template.

        Args:
            messages: non-empty list of dicts, each with str ``role`` and str ``content``; other
                keys are passed to the template as they are (assistant ``tool_calls``, a
                tool result's ``tool_call_id``).
            add_generation_prompt: end with the header that opens the assistant's turn.
            tools: the functions the model may call, as the template's ``tools``; a template
                that never reads them gets them (and the calls and results in ``messages``)
                written as Hermes-style text (``chat_template.with_tools``).

        Raises:
            ValueError: bad messages, no chat template, or the template raised an error.
        """
        return self._render(messages, add_generation_prompt, tools)[0]

    def _render(self, messages, add_generation_prompt: bool, tools) -> tuple[str, list[dict]]:
        """The rendered chat and the messages as the template got them."""
        if self._chat_template is None:
            raise InvalidRequest("messages", "this model has no chat template")
        native = "tools" in self._chat_template and "tool_call" in self._chat_template
        if not native and (
            tools
            or any(
                m.get("tool_calls") or m.get("role") == "tool"
                for m in messages
                if isinstance(m, Mapping)
            )
        ):
            messages, tools = with_tools(messages, tools), None
        check_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = compile_template(self._chat_template)
        messages = [dict(m) for m in messages]
        try:
            text = self._compiled_template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._template_tokens(),
            )
            return text, messages
        except jinja2.TemplateError as exc:
            raise InvalidRequest("messages", f"rendering the chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        max_chars: int | None = None,
        tools: list[dict] | None = None,
        answers: Callable[[str], Sequence[int] | None] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat; BOS is not added again if the template wrote it.
        A rendering longer than ``max_chars`` is refused before it is tokenized
        (``ContextLengthExceeded`` naming ``messages``). ``continue_final_message``: the
        last message is left open, the rendering cut right after its content (no end of
        turn, no generation prompt), for the model to go on with it (a prefill).

        ``answers(text)``: the token ids the model generated as an assistant message's
        ``text``, if it did (``RecentAnswers``). Those ids stand in the prompt for the text,
        the rest tokenized around them: a model's answer is not always the canonical
        tokenization of its text (a grammar-constrained tool call seldom is), and a prompt
        that repeats the ids hits the blocks the answer's turn cached."""
        generation = add_generation_prompt and not continue_final_message
        text, rendered = self._render(messages, generation, tools)
        if continue_final_message:
            text = _open_final(text, rendered)
        check_rendered_length(text, max_chars)
        bos = self._template_tokens().get("bos_token")
        first = not (bos and text.startswith(bos))
        ids: list[int] = []
        cursor = 0
        for m in rendered if answers is not None else ():
            content = m.get("content")
            known = answers(content) if m.get("role") == "assistant" and content else None
            start = text.find(content, cursor) if known else -1
            if start < 0:
                continue
            ids += self.encode(text[cursor:start], add_special_tokens=first and not cursor)
            ids += known
            cursor = start + len(content)
        return ids + self.encode(text[cursor:], add_special_tokens=first and not cursor)

    def _template_tokens(self) -> dict[str, str]:
        names = {"bos_token": self._bos_token_id, "eos_token": self._eos_token_id}
        return {
            name: self._backend.id_to_token(i)
            for name, i in names.items()
            if i is not None and self._backend.id_to_token(i) is not None
        }


def _open_final(text: str, rendered: list[dict]) -> str:
    """The rendered chat cut right after its last message's content (HF's
    ``continue_final_message``); an InvalidRequest naming ``messages`` where the template does
    not write that content as it is."""
    final = rendered[-1].get("content") if rendered else None
    at = text.rfind(final) if isinstance(final, str) and final else -1
    if at < 0:
        raise InvalidRequest(
            "messages",
            "the last message cannot be continued: the chat "
            "template does not write its content as it is",
        )
    return text[: at + len(final)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
