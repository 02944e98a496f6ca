"""Tokenizer: GGUF and HF-directory loading, encoding and chat templates.

The GGUF tests compare against transformers' tokenizer built from the same file (the reference);
they are skipped when the default model or transformers is not installed.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from kvwise.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows line",
    "\n\n\n",
    "def f(x):\n    return x * 2  # double\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Numbers: 0 7 42 1234567890 3.14159 -2e10 1,000,000",
    "Dates 2024-01-01 and times 12:34:56",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "中文文本测试，你好世界。",
    "日本語のテキストです。",
    "한국어 텍스트",
    "Café déjà vu, naïve façade, Ångström, Straße",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "Math: ∑ ∫ √2 ≈ 1.414, ½ ² ① ٣",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "almost special <|im_start and <im_end|>",
    "don't we'll they're I'm you've she'd it's",
    "UPPER lower MiXeD CamelCaseWord snake_case_word",
    "https://example.com/path?query=1&x=y#frag",
    "a" * 300,
    "     \n   \n\t  ",
    "Mixed: abc123def 456ghi 😀7",
    "zero\u200bwidth and \u00a0nbsp and combining e\u0301",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\nExplain 😀."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces  "},
    ],
]


@pytest.fixture(scope="module")
def ref(gguf_path):
    """transformers' tokenizer for the GGUF: what ``AutoTokenizer.from_pretrained(dir,
    gguf_file=name)`` builds, by the same two calls, without its model-config pass (which parses
    the file again with GGUFReader and costs ~8 s). Checked equal on TEXTS and CONVERSATIONS."""
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


# ---- GGUF tokenizer vs transformers ---------------------------------------------------------


def test_gguf_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.encode("<|im_start|>") == [1]


@pytest.fixture(scope="module")
def ref_digits(ref) -> Backend:
    """The reference with the original SmolLM2 tokenizer.json split (digits isolated first)."""
    backend = Backend.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref, ref_digits, text: str) -> None:
    ids = tok.encode(text)
    # NOTE: transformers does not know pre "smollm" and falls back to plain GPT-2 splitting, which
    # lets BPE merge a space into the first byte of a non-ASCII number (" ½" -> "ĠÂ", "½").
    # llama.cpp and the model's own tokenizer.json isolate every \p{N} first; we follow them.
    if any(c.isnumeric() and not c.isascii() for c in text):
        assert ids == ref_digits.encode(text).ids
        assert ids != ref.encode(text)
    else:
        assert ids == ref.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_bytes_missing_from_vocab_are_dropped_like_transformers(tok: Tokenizer, ref) -> None:
    # SmolLM2's vocabulary has no token for some bytes (0x04, 0xF1, 0xF2, ...): BPE without an
    # unknown token drops them, so U+40000 (F1 80 80 80) loses its lead byte. Same in the reference.
    text = "a\x04b\U00040000c"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == "ab\ufffd\ufffd\ufffdc"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, ref, messages, add_generation_prompt) -> None:
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    expected_ids = ref.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_continue_final_message_matches_transformers(tok, ref, messages) -> None:
    """A last assistant message left open (a prefill): the rendering cut after its content,
    as transformers' continue_final_message cuts it."""
    messages = [*messages, {"role": "assistant", "content": "The answer is"}]
    expected = ref.apply_chat_template(messages, tokenize=True, continue_final_message=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    got = tok.encode_chat(messages, continue_final_message=True)
    assert got == expected and tok.decode(got).endswith("assistant\nThe answer is")
    with pytest.raises(ValueError, match="^messages: the last message cannot be continued"):
        tok.encode_chat(
            [*messages[:-1], {"role": "assistant", "content": ""}], continue_final_message=True
        )


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"], [{"content": "x"}]],
)
def test_bad_messages(tok: Tokenizer, messages) -> None:
    with pytest.raises(ValueError, match="^messages: "):
        tok.apply_chat_template(messages)


# ---- a tiny Hugging Face directory -----------------------------------------------------------


def _write_hf_dir(tmp_path, *, template=True, add_bos=True):
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "a": 3, "b": 4, "c": 5, "ab": 6, "Ġ": 7}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "add_bos_token": add_bos,
    }
    if template:
        config["chat_template"] = (
            "{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
        )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return tmp_path


def test_hf_dir(tmp_path) -> None:
    tok = Tokenizer.from_path(_write_hf_dir(tmp_path))
    assert tok.vocab_size == 8
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == frozenset({1, 2})
    assert tok.encode("ab c") == [0, 6, 7, 5]
    assert tok.encode("ab c", add_special_tokens=False) == [6, 7, 5]
    assert tok.decode([0, 6, 7, 5, 2]) == "ab c"
    messages = [{"role": "a", "content": "b"}]
    assert tok.apply_chat_template(messages) == "<s>a:b</s>assistant:"
    assert tok.encode_chat(messages)[:2] == [0, 3]  # BOS once, from the template


def test_hf_dir_int_eos_and_no_template(tmp_path) -> None:
    path = _write_hf_dir(tmp_path, template=False, add_bos=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = Tokenizer.from_path(path)
    assert tok.eos_token_ids == frozenset({1, 2})
    assert tok.encode("ab") == [6]
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_dir_chat_template_file(tmp_path) -> None:
    path = _write_hf_dir(tmp_path)
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_path(path)
    assert tok.apply_chat_template([{"role": "user", "content": "c"}]) == "c!"


def test_from_path_rejects_unknown(tmp_path) -> None:
    with pytest.raises(ValueError, match="^path: "):
        Tokenizer.from_path(tmp_path)
    with pytest.raises(ValueError, match="^path: "):
        Tokenizer.from_path(tmp_path / "missing.gguf")


FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{{ bos_token }}{{ m | tojson }}\n"
    "  {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[{{ ns.n }}]{% endif %}"
    "{% if strftime_now('%Y') | length != 4 %}bad year{% endif %}"
)


def test_chat_template_features_match_transformers(tmp_path) -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    path = _write_hf_dir(tmp_path)
    (path / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    tok = Tokenizer.from_path(path)
    messages = [
        {"role": "user", "content": "  héllo <b>&</b> 😀 "},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": 'say "hi"', "name": "bot"},
    ]
    for add_generation_prompt in (True, False):
        expected = render_jinja_template(
            [messages],
            chat_template=FEATURE_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        expected = expected[0] if isinstance(expected, tuple) else expected
        expected = expected[0] if isinstance(expected, list) else expected
        assert tok.apply_chat_template(messages, add_generation_prompt) == expected
    with pytest.raises(ValueError, match="^messages: .*no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


def test_chat_template_sandbox(tmp_path) -> None:
    path = _write_hf_dir(tmp_path)
    (path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="^messages: "):
        Tokenizer.from_path(path).apply_chat_template([{"role": "u", "content": "c"}])
    (path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}")
    with pytest.raises(ValueError, match="^messages: "):
        Tokenizer.from_path(path).apply_chat_template([{"role": "u", "content": "c"}])


def _write_gguf(path, model: str, pre: str):
    import gguf

    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "1", "2", "3"]
    tokens = ["<|end|>", *alphabet, "ab", "Ġab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_eos_token_id(0)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tokens


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2", "smollm"])
def test_tiny_gguf(tmp_path, pre) -> None:
    import gguf

    path, tokens = _write_gguf(tmp_path / "tiny.gguf", "gpt2", pre)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.eos_token_ids == frozenset({0, 1})
    assert tok.bos_token_id is None
    ids = tok.encode("ab ab<|end|>c")
    assert [tokens[i] for i in ids] == ["ab", "Ġab", "<|end|>", "c"]
    assert tok.decode(ids) == "ab abc"
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


def test_gguf_rejects_unsupported(tmp_path) -> None:
    """A SentencePiece ("llama") vocabulary without its scores, and an unknown pre-tokenizer."""
    path, _ = _write_gguf(tmp_path / "spm.gguf", "llama", "default")
    with pytest.raises(ValueError, match="^path: GGUF tokenizer model 'llama'"):
        Tokenizer.from_path(path)
    path, _ = _write_gguf(tmp_path / "odd.gguf", "gpt2", "mystery")
    with pytest.raises(ValueError, match="^path: GGUF pre-tokenizer 'mystery'"):
        Tokenizer.from_path(path)


def test_encoding_a_huge_text_lets_other_threads_run(tok: Tokenizer) -> None:
    """A huge prompt is tokenized on the engine thread; the server's event loop must keep
    answering meanwhile (``tokenizers``' plain ``encode`` holds the GIL throughout)."""
    import threading
    import time

    text = "lorem ipsum dolor sit amet consectetur " * 30_000  # 1.2 MB: ~0.5 s to encode
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert len(ids) > 100_000 and took > 0.1
    assert max(gaps) < took / 2, (max(gaps), took)  # the ticker ran all along


def test_max_token_chars_bounds_every_token(tok: Tokenizer) -> None:
    assert tok.max_token_chars >= len("<|im_start|>")
    for text in TEXTS:
        assert len(text) <= len(tok.encode(text, add_special_tokens=False)) * tok.max_token_chars
