"""A GGUF file's tokenizer rebuilt as a `tokenizers.Tokenizer`. No torch here.

A GGUF has no tokenizer.json: it stores the vocabulary under llama.cpp's keys. `read_gguf_tokenizer`
reads them and builds the equivalent backend for the two vocabularies people download:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from the vocabulary and merges, split as
  llama.cpp splits for ``tokenizer.ggml.pre``;
- ``tokenizer.ggml.model == "llama"``: SentencePiece (Llama 2, Mistral, Gemma). llama.cpp
  tokenizes these by merging the adjacent pair whose merged piece scores best, starting from
  characters, with ``<0xXX>`` byte pieces for characters the vocabulary lacks. That is BPE with
  the merges ranked by score, which is what we build (`build_sentencepiece`).

The reference is the tokenizer transformers builds from the same file
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``): ids identical on encode, with and without
special tokens, and text identical on decode. Where the two projects differ we follow
transformers, except that the file's own ``add_space_prefix`` and ``unknown_token_id`` are obeyed
(transformers drops both; llama.cpp and sentencepiece honour them):

- the "▁" prefix is added to the text's first piece only, and not when it starts with a space
  (llama.cpp adds one after every special token too, and always);
- BOS is added by the post-processor even when the text starts with it (so does llama.cpp);
- gemma-family files (``general.architecture`` gemma, gemma2, gemma3): whitespace tokens stored
  with real spaces are spelled with "▁", and the merges are ranked by position in the file;
  phi3: the prefix "▁" is added to every piece between special tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

_log = logging.getLogger(__name__)

# values of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = range(1, 7)
SPACE_PIECE = "\u2581"  # "▁": how a SentencePiece vocabulary spells a space

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
GGUF_PRE_SPLITS = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "digits+gpt2",
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}
# Architectures whose SentencePiece files transformers reads its own way (see the module doc).
_GEMMA_FAMILY = frozenset({"gemma", "gemma2", "gemma3"})
_PREFIX_EVERY_PIECE = frozenset({"phi3"})


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer: the backend plus the ids around it.

    ``add_bos_token`` asks the caller to prepend BOS; it is False when the backend's
    post-processor already adds BOS (and EOS), as for SentencePiece files.
    """

    backend: Backend
    bos_token_id: int | None
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None


def read_gguf_tokenizer(reader: Any) -> GGUFTokenizer:
    """Build the tokenizer an open `gguf.GGUFReader` describes.

    Raises:
        ValueError: (naming ``path``) a tokenizer model or pre-tokenizer this module cannot build,
            or a vocabulary without the keys it needs.
    """

    def field(key: str, default: Any = None) -> Any:
        f = reader.get_field(key)
        return default if f is None else f.contents()

    model = field("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"path: GGUF tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE,"
            " and 'llama', SentencePiece)"
        )
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("path: the GGUF file has no tokenizer.ggml.tokens")
    token_types: list[int] = field("tokenizer.ggml.token_type", [])
    ids = {k: field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    if model == "gpt2":
        backend = build_byte_level_bpe(
            tokens, field("tokenizer.ggml.merges", []), token_types, _pre_split(field)
        )
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
    else:
        scores = field("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ValueError(
                f"path: GGUF tokenizer model 'llama' (SentencePiece) needs one score per token in "
                f"tokenizer.ggml.scores; the file has {len(scores or ())} for {len(tokens)} tokens"
            )
        vocab = SentencePieceVocab(
            tokens=tokens,
            scores=scores,
            token_types=token_types,
            architecture=field("general.architecture", ""),
            add_space_prefix=field("tokenizer.ggml.add_space_prefix"),
            add_bos_token=field("tokenizer.ggml.add_bos_token", True),  # llama.cpp's default
            add_eos_token=field("tokenizer.ggml.add_eos_token", False),
            special_ids={k: v for k, v in ids.items() if v is not None},
        )
        backend, add_bos = build_sentencepiece(vocab), False  # the post-processor adds BOS
    extra_eos = (field(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom"))
    return GGUFTokenizer(
        backend=backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        extra_eos_token_ids=tuple(i for i in extra_eos if i is not None),
        add_bos_token=add_bos,
        chat_template=field("tokenizer.chat_template"),
    )


def _pre_split(field) -> str:
    pre = field("tokenizer.ggml.pre", "gpt-2")
    if pre not in GGUF_PRE_SPLITS:
        raise ValueError(
            f"path: GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(GGUF_PRE_SPLITS)}"
        )
    return pre


# ---- byte-level BPE ("gpt2") ------------------------------------------------------------------


def build_byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str
) -> Backend:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp-style vocabulary data.

    Args:
        tokens: vocabulary, index = token id, in the byte-level alphabet (``"Ġthe"``).
        merges: ``"left right"`` pairs, best first.
        token_types: llama.cpp token types; control (3) tokens become special added tokens and
            user-defined (4) ones plain added tokens, so that they match whole in text.
        pre: a ``tokenizer.ggml.pre`` value listed in `GGUF_PRE_SPLITS`.
    """
    alphabet = _BYTE_ALPHABET
    vocab = {
        t if set(t) <= alphabet else "".join(_BYTE_SPELLING[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    split = GGUF_PRE_SPLITS[pre]
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
            if kind == GGUF_CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in typed
            if kind == GGUF_USER_DEFINED and t in vocab
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


# ---- SentencePiece ("llama") ------------------------------------------------------------------


@dataclass(frozen=True)
class SentencePieceVocab:
    """A SentencePiece vocabulary as a GGUF stores it (index = token id).

    Args:
        tokens: the pieces, spaces spelled "▁", bytes as ``<0xXX>``.
        scores: one per token; a higher score merges first.
        token_types: llama.cpp token types (empty: all normal).
        architecture: ``general.architecture`` (picks transformers' per-family reading).
        add_space_prefix: prepend "▁" to the text; None when the file does not say (then yes).
        add_bos_token / add_eos_token: what encoding with special tokens adds.
        special_ids: the named ids present, by key: ``bos``, ``eos``, ``unknown``, ``padding``.
    """

    tokens: Sequence[str]
    scores: Sequence[float]
    token_types: Sequence[int]
    architecture: str
    add_space_prefix: bool | None
    add_bos_token: bool
    add_eos_token: bool
    special_ids: Mapping[str, int]


def build_sentencepiece(vocab: SentencePieceVocab) -> Backend:
    """The `tokenizers.Tokenizer` equivalent to llama.cpp's SPM tokenizer over `vocab`.

    BPE with byte fallback: merges ranked by the merged piece's score (`score_ranked_merges`),
    spaces as "▁" with the optional prefix, control tokens and the named special tokens as
    special added tokens, user-defined ones as plain added tokens (matched whole in text), BOS
    and EOS added by the post-processor. Decoding inverts it: byte pieces joined back into
    UTF-8, "▁" back to a space, the prefix space stripped.

    Raises:
        ValueError: (naming ``path``) a special id outside the vocabulary, or BOS/EOS asked for
            and not named.
    """
    gemma = vocab.architecture in _GEMMA_FAMILY
    tokens = [_respell_spaces(t) for t in vocab.tokens] if gemma else list(vocab.tokens)
    # NOTE: transformers ranks a gemma file's merges by position, not score (their control
    # tokens score -1000, amid the rest); the ids must match its.
    ranks = [-i for i in range(len(tokens))] if gemma else vocab.scores
    ids = {t: i for i, t in enumerate(tokens)}  # a repeated piece keeps its last id
    special = _named_special_tokens(vocab, tokens)
    unk = special.get("unknown")
    bpe = models.BPE(
        vocab=ids,
        merges=score_ranked_merges(tokens, ranks, ids),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(bpe)
    prefix = vocab.add_space_prefix is not False  # llama.cpp's default: prefix
    if prefix and vocab.architecture in _PREFIX_EVERY_PIECE:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE_PIECE), normalizers.Replace(" ", SPACE_PIECE)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE_PIECE, prepend_scheme="first" if prefix else "never", split=False
        )
    steps = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    _add_sentencepiece_tokens(backend, vocab, tokens, ids, special)
    backend.post_processor = _bos_eos_template(vocab, tokens, special)
    return backend


def score_ranked_merges(
    tokens: Sequence[str], ranks: Sequence[float], ids: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every way to build a piece from two pieces, best-ranked result first.

    For each piece, each split into two pieces both in `ids`; ordered by the rank of the piece
    they make (higher first), then the longer left part, then the longer right part, then
    piece order and the parts' ids: the order transformers' ``generate_merges`` gives, so that
    ties between equal scores break the same way.
    """
    rank_of = dict(zip(tokens, ranks))  # first position, last rank, as transformers iterates
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, rank in rank_of.items():
        size = len(piece)
        splits = [
            (ids[left], ids[right], k, left, right)
            for k in range(1, size)
            if (left := piece[:k]) in ids and (right := piece[k:]) in ids
        ]
        splits.sort()
        merges.extend((rank, k, size - k, left, right) for _, _, k, left, right in splits)
    merges.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys keep their order
    return [(left, right) for _, _, _, left, right in merges]


def _respell_spaces(token: str) -> str:
    """A whitespace-only piece holding a space, as gemma files store runs of spaces, in "▁"."""
    return SPACE_PIECE * len(token) if " " in token and not token.strip() else token


def _named_special_tokens(vocab: SentencePieceVocab, tokens: Sequence[str]) -> dict[str, int]:
    """The named ids to use. An unknown or padding id outside the vocabulary (some converters
    write one) is dropped with a warning, as llama.cpp drops it; a bad BOS or EOS is an error."""
    special = {}
    for key, token_id in vocab.special_ids.items():
        if 0 <= token_id < len(tokens):
            special[key] = token_id
        elif key in ("unknown", "padding"):
            _log.warning("tokenizer.ggml.%s_token_id %d is not in the vocabulary", key, token_id)
        else:
            raise ValueError(
                f"path: tokenizer.ggml.{key}_token_id {token_id} is not in the vocabulary of "
                f"{len(tokens)}"
            )
    for key, asked in (("bos", vocab.add_bos_token), ("eos", vocab.add_eos_token)):
        if asked and key not in special:
            raise ValueError(f"path: the GGUF asks for add_{key}_token but names no {key} token")
    return special


def _add_sentencepiece_tokens(
    backend: Backend,
    vocab: SentencePieceVocab,
    tokens: Sequence[str],
    ids: Mapping[str, int],
    special: Mapping[str, int],
) -> None:
    """User-defined tokens as plain added tokens (matched whole in text), each only if the file
    spells it as the vocabulary does; control tokens and the named special ones (BOS, EOS,
    unknown, padding) that are not user-defined as special added tokens."""
    kinds = list(vocab.token_types) or [GGUF_NORMAL] * len(tokens)
    user_defined = [
        i for i, kind in enumerate(kinds) if kind == GGUF_USER_DEFINED and vocab.tokens[i] in ids
    ]
    named = set(special.values()) - set(user_defined)
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for i, (t, kind) in enumerate(zip(tokens, kinds))
            if t and (kind == GGUF_CONTROL or i in named)
        ]
    )
    backend.add_tokens(
        [AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user_defined]
    )


def _bos_eos_template(
    vocab: SentencePieceVocab, tokens: Sequence[str], special: Mapping[str, int]
) -> processors.TemplateProcessing:
    """``[BOS] $A [EOS]`` as the file asks (a pair: the second sequence framed the same way)."""
    asked = [k for k, on in (("bos", vocab.add_bos_token), ("eos", vocab.add_eos_token)) if on]
    ends = {tokens[special[k]]: special[k] for k in asked}
    bos = [tokens[special["bos"]]] if vocab.add_bos_token else []
    eos = [tokens[special["eos"]]] if vocab.add_eos_token else []
    single = [*bos, "$A:0", *eos]
    # a list, not one string: the template parser splits a string at spaces
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(ends.items())
    )
