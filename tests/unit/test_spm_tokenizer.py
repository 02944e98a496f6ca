"""GGUF SentencePiece tokenizers (``tokenizer.ggml.model == "llama"``) on tiny vocabularies.

Each file is made here: a SentencePiece BPE model trained on a small corpus (byte fallback on,
user-defined and control symbols), written with `gguf.GGUFWriter` as a one-layer llama-shaped
model with the tokenizer keys llama.cpp's converter writes. The reference is the tokenizer
transformers builds from the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``);
sentencepiece itself checks what transformers gets wrong (the file's ``add_space_prefix`` and
its unknown token). The real 262k-token Gemma 3 file: tests/model/test_gguf_spm_tokenizer.py.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvwise.engine.gguf_tokenizer import (  # noqa: E402
    GGUF_BYTE,
    GGUF_CONTROL,
    GGUF_NORMAL,
    GGUF_UNKNOWN,
    GGUF_USER_DEFINED,
    score_ranked_merges,
)
from kvwise.engine.tokenizer import Tokenizer  # noqa: E402
from tests.tokenizer_util import assert_same_as  # noqa: E402

USER_DEFINED = ["<|im_start|>", "<|im_end|>"]
CONTROL = ["<ctrl>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 1234 3.14159 and dates 2024-01-01 12:34:56.",
    "def f(x):",
    "    return x * 2  # double it",
    "        deeply   indented    code\twith\ttabs",
    "中文文本测试，你好世界。日本語のテキストです。한국어 텍스트",
    "Emoji 😀 👍 and café déjà vu, naïve façade, Straße, Ελληνικά και русский.",
    "the then there these those other another brother mother weather whether",
] * 20

TEXTS = [
    "Hello world",
    "",
    " ",
    "  ",
    " Hello",
    "   leading and trailing spaces   ",
    "Hello  world   with    runs     of spaces",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows line",
    "\n\n\n",
    "     \n   \n\t  ",
    "def f(x):\n    return x * 2  # double\n",
    "Numbers: 0 7 42 1234567890 3.14159 -2e10 1,000,000",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "中文文本测试，你好世界。",
    "日本語のテキストです。한국어 텍스트",
    "Café déjà vu, naïve façade, Ångström, Straße",
    "rare: \x04\x7f \U00040000 \u2581 \ufffd ∑ ∫ √2 ½ ①",
    "zero\u200bwidth and \u00a0nbsp and combining e\u0301",
    "<s>Hello</s> world",
    " <s> spaced </s> ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<ctrl>text <ctrl> x",
    "almost special <|im_start and <s <0x41> <unk>",
    "a" * 300,
    "the then there these those other another",
]


def _train(*, byte_fallback: bool = True, add_dummy_prefix: bool = True):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=byte_fallback,
        character_coverage=0.98,  # the rarest characters are left to byte fallback
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return GGUF_UNKNOWN
    if sp.is_control(i):
        return GGUF_CONTROL
    if sp.is_byte(i):
        return GGUF_BYTE
    return GGUF_USER_DEFINED if sp.id_to_piece(i) in USER_DEFINED else GGUF_NORMAL


def _write_gguf(
    path,
    sp,
    *,
    arch="llama",
    add_space_prefix=None,
    add_eos=False,
    add_bos=True,
    bos_id=1,
    pad_id=None,
):
    """A one-layer `arch` model (random weights) with `sp`'s vocabulary, as llama.cpp writes it."""
    num_tokens, hidden = sp.get_piece_size(), 8
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(4)
    writer.add_vocab_size(num_tokens)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(num_tokens)])
    writer.add_token_scores([sp.get_score(i) for i in range(num_tokens)])
    writer.add_token_types([_token_type(sp, i) for i in range(num_tokens)])
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if pad_id is not None:
        writer.add_pad_token_id(pad_id)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (num_tokens, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (8, hidden),
        "blk.0.attn_k.weight": (4, hidden),
        "blk.0.attn_v.weight": (4, hidden),
        "blk.0.attn_output.weight": (hidden, 8),
        "blk.0.ffn_gate.weight": (16, hidden),
        "blk.0.ffn_up.weight": (16, hidden),
        "blk.0.ffn_down.weight": (hidden, 16),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def sp():
    return _train()


@pytest.fixture(scope="module")
def llama_gguf(sp, tmp_path_factory):
    return _write_gguf(tmp_path_factory.mktemp("spm") / "tiny-llama.gguf", sp)


@pytest.fixture(scope="module")
def tok(llama_gguf) -> Tokenizer:
    return Tokenizer.from_path(llama_gguf)


@pytest.fixture(scope="module")
def ref(llama_gguf):
    return _reference(llama_gguf)


def test_metadata(tok: Tokenizer, sp) -> None:
    assert tok.vocab_size == sp.get_piece_size()
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, frozenset({2}))
    # control tokens and the named unknown/BOS/EOS are special; user-defined ones are not
    assert tok.special_token_ids == {0, 1, 2, sp.piece_to_id("<ctrl>")}
    assert tok.encode("") == [1]  # BOS, as llama.cpp and transformers add it
    assert tok.encode("", add_special_tokens=False) == []


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    assert_same_as(tok, ref, text)


@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma3"])
def test_families_match_transformers(sp, tmp_path, arch: str) -> None:
    """transformers reads some families' SentencePiece files its own way: phi3 prefixes "▁" to
    every piece between special tokens, gemma3 (whose converter writes add_space_prefix =
    false) ranks merges by position."""
    prefix = False if arch == "gemma3" else None
    path = _write_gguf(tmp_path / f"{arch}.gguf", sp, arch=arch, add_space_prefix=prefix)
    tok, ref = Tokenizer.from_path(path), _reference(path)
    for text in TEXTS:
        assert_same_as(tok, ref, text)


def test_pieces(tok: Tokenizer, sp) -> None:
    ids = tok.encode("<|im_start|>x 😀\x04", add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    # a user-defined token whole, the first piece after it without the prefix space, bytes for
    # what the vocabulary lacks
    assert pieces[:2] == ["<|im_start|>", "x"]
    assert pieces[-5:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x04>"]
    assert tok.decode(ids) == "<|im_start|>x 😀\x04"
    assert tok.decode(tok.encode("Hello world")) == "Hello world"  # the prefix space stripped


def test_same_ids_as_sentencepiece(tok: Tokenizer, sp) -> None:
    """Score-ranked BPE merging is sentencepiece's own algorithm: the same ids, on text that
    neither starts with a space (transformers then adds no "▁") nor holds special tokens."""
    for text in TEXTS:
        if text.startswith(" ") or "<" in text:
            continue
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text


def test_no_space_prefix_is_obeyed(sp, tmp_path) -> None:
    """``add_space_prefix = false``: no "▁" before the text (as llama.cpp and sentencepiece do;
    transformers ignores the key and adds one), and none stripped when decoding."""
    sp_plain = _train(add_dummy_prefix=False)
    tok = Tokenizer.from_path(
        _write_gguf(tmp_path / "plain.gguf", sp_plain, add_space_prefix=False)
    )
    for text in TEXTS:
        if "<" in text:
            continue
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp_plain.encode(text), text
        assert tok.decode(ids) == text.replace("\u2581", " ")  # a "▁" in text is a space
    ref = _reference(tmp_path / "plain.gguf")
    assert ref.encode("Hello", add_special_tokens=False) != tok.encode("Hello", False)


def test_eos_and_no_bos(sp, tmp_path) -> None:
    path = _write_gguf(tmp_path / "eos.gguf", sp, add_eos=True, add_bos=False)
    tok, ref = Tokenizer.from_path(path), _reference(path)
    assert tok.encode("Hello") == [*tok.encode("Hello", add_special_tokens=False), 2]
    for text in TEXTS[:8]:
        assert_same_as(tok, ref, text)


def test_unknown_characters_without_byte_fallback(tmp_path) -> None:
    """A vocabulary without byte pieces: a character it lacks is the unknown token, as in
    sentencepiece and llama.cpp (transformers' llama tokenizer sets no unknown token on its BPE
    model and drops the character)."""
    sp_nobytes = _train(byte_fallback=False)
    tok = Tokenizer.from_path(_write_gguf(tmp_path / "nobytes.gguf", sp_nobytes))
    text = "rare 😀 ∑ here"
    assert tok.encode(text, add_special_tokens=False) == sp_nobytes.encode(text)
    assert 0 in sp_nobytes.encode(text)


def test_merges_ranked_as_transformers_ranks_them() -> None:
    """Ties between equal scores broken as transformers breaks them (longer left part, longer
    right part, then vocabulary order), on a vocabulary full of ties."""
    from transformers.tokenization_utils_base import generate_merges

    rng = np.random.default_rng(1)
    tokens = ["a", "b", "c", "aa", "ab", "bc", "ca", "abc", "bca", "aab", "abca", "cab", "bb"]
    scores = [float(s) for s in rng.integers(-3, 0, len(tokens))]
    ids = {t: i for i, t in enumerate(tokens)}
    expected = generate_merges(ids, dict(zip(tokens, scores)))
    assert score_ranked_merges(tokens, scores, ids) == [tuple(m) for m in expected]
    assert score_ranked_merges(["a", "b", "ab"], [0.0, 0.0, -1.0], {"a": 0, "b": 1, "ab": 2}) == [
        ("a", "b")
    ]


def test_refusals(sp, tmp_path) -> None:
    bad_bos = _write_gguf(tmp_path / "bad-bos.gguf", sp, bos_id=10**6)
    with pytest.raises(ValueError, match="^path: tokenizer.ggml.bos_token_id 1000000 is not in"):
        Tokenizer.from_path(bad_bos)
    # a padding id past the vocabulary (some converters write one) is dropped, as llama.cpp does
    tok = Tokenizer.from_path(_write_gguf(tmp_path / "bad-pad.gguf", sp, pad_id=10**6))
    assert tok.encode("Hello") == Tokenizer.from_path(_write_gguf(tmp_path / "ok.gguf", sp)).encode(
        "Hello"
    )
    no_bos = _write_gguf(tmp_path / "no-bos.gguf", sp, bos_id=None)
    with pytest.raises(ValueError, match="^path: the GGUF asks for add_bos_token but names no"):
        Tokenizer.from_path(no_bos)
