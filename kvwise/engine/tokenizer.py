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
- a GGUF file with a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``). A GGUF has no
  tokenizer.json, so the tokenizer is rebuilt from the vocabulary and merges, with the split rule
  llama.cpp uses for ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from kvwise.engine.chat_template import (
    check_messages,
    check_rendered_length,
    compile_template,
    pick_template,
)
from kvwise.errors import InvalidRequest

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # values of tokenizer.ggml.token_type

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (llama-vocab.cpp). "gpt2" is
# ByteLevel's own regex; "digits+gpt2" first isolates every digit (\p{N}), as the original
# tokenizer.json of these models does with `Digits(individual_digits=True)`.
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "digits+gpt2",
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}


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
            source: a path, or an open `gguf.GGUFReader` (opening one parses all metadata, about
                3 s for a 49k vocabulary, so a caller that also loads weights can share it).
        """
        import gguf

        reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)

        def field(key: str, default: Any = None) -> Any:
            f = reader.get_field(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"path: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        pre = field("tokenizer.ggml.pre", "gpt-2")
        if pre not in _GGUF_PRE_SPLITS:
            raise ValueError(
                f"path: GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_GGUF_PRE_SPLITS)}"
            )
        tokens: list[str] | None = field("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("path: the GGUF file has no tokenizer.ggml.tokens")
        merges: list[str] = field("tokenizer.ggml.merges", [])
        token_types: list[int] = field("tokenizer.ggml.token_type", [])
        backend = build_byte_level_bpe(tokens, merges, token_types, pre)
        eos_token_id = field("tokenizer.ggml.eos_token_id")
        extra_eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        return cls(
            backend,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos_token_id,
            extra_eos_token_ids=[i for i in extra_eos if i is not None],
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
            chat_template=field("tokenizer.chat_template"),
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

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling for BPE), or None."""
        return self._backend.id_to_token(token_id)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` with the model's chat template.

        Args:
            messages: non-empty list of dicts, each with str ``role`` and str ``content``; other
                keys are passed to the template as they are.
            add_generation_prompt: end with the header that opens the assistant's turn.

        Raises:
            ValueError: bad messages, no chat template, or the template raised an error.
        """
        check_messages(messages)
        if self._chat_template is None:
            raise InvalidRequest("messages", "this model has no chat template")
        if self._compiled_template is None:
            self._compiled_template = compile_template(self._chat_template)
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._template_tokens(),
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest("messages", f"rendering the chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        max_chars: int | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; BOS is not added again if the template wrote it.
        A rendering longer than ``max_chars`` is refused before it is tokenized
        (``ContextLengthExceeded`` naming ``messages``)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        check_rendered_length(text, max_chars)
        bos = self._template_tokens().get("bos_token")
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def _template_tokens(self) -> dict[str, str]:
        names = {"bos_token": self._bos_token_id, "eos_token": self._eos_token_id}
        return {
            name: self._backend.id_to_token(i)
            for name, i in names.items()
            if i is not None and self._backend.id_to_token(i) is not None
        }


def build_byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str
) -> Backend:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp-style vocabulary data.

    Args:
        tokens: vocabulary, index = token id, in the byte-level alphabet (``"Ġthe"``).
        merges: ``"left right"`` pairs, best first.
        token_types: llama.cpp token types; control (3) tokens become special added tokens and
            user-defined (4) ones plain added tokens, so that they match whole in text.
        pre: a ``tokenizer.ggml.pre`` value listed in `_GGUF_PRE_SPLITS`.
    """
    alphabet = _BYTE_ALPHABET
    vocab = {
        t if set(t) <= alphabet else "".join(_BYTE_SPELLING[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    split = _GGUF_PRE_SPLITS[pre]
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        ignore_merges=split == "llama3",  # llama.cpp sets ignore_merges for these
    )
    backend = Backend(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.endswith("gpt2"))
    if split == "gpt2":
        backend.pre_tokenizer = byte_level
    elif split == "digits+gpt2":
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        regex = _LLAMA3_SPLIT if split == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level]
        )
    backend.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a converter's mislabel, and adding
    # it would grow the vocabulary past the model's; transformers skips those too.
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in typed
            if kind == _GGUF_CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in typed
            if kind == _GGUF_USER_DEFINED and t in vocab
        ]
    )
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_SPELLING = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING.values())


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
