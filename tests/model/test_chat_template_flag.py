"""``--chat-template`` / ``LLM(chat_template=...)`` (issue 44): the Gemma 3 270M base GGUF ships
no chat template, so every chat is refused; given one, it answers chats rendered by that
template (its marker is in the prompt's token ids), through the Python API and ``kvwise
generate``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvwise import LLM, SamplingParams
from kvwise.errors import InvalidRequest
from kvwise.models.default import gemma3_model_path

# Gemma's turn markers, and a marker of this template's own in the header of each turn
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}"
    "\n[kvwise-template] {{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RENDERED = (
    "<start_of_turn>user\n[kvwise-template] What is the capital of France?<end_of_turn>\n"
    "<start_of_turn>model\n"
)
ENGINE = {"kv_cache_memory": "64MiB", "kv_host_memory": "off", "kv_disk_path": "off"}


@pytest.fixture(scope="module")
def gemma3_path():
    try:
        return gemma3_model_path()
    except ValueError as exc:  # under CI=true this skip fails: install.sh assembles the file
        pytest.skip(str(exc))


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text(TEMPLATE)
    return path


def test_the_base_gguf_has_no_chat_template_and_a_given_one_answers_chats(
    gemma3_path, template_file
):
    params = SamplingParams(max_tokens=8, temperature=0)
    with LLM(gemma3_path, progress=False, **ENGINE) as llm:
        assert llm.tokenizer.chat_template is None
        with pytest.raises(InvalidRequest, match="this model has no chat template"):
            llm.chat(CHAT, params)
        raw = llm.generate(RENDERED, params)[0]
    with LLM(gemma3_path, progress=False, chat_template=str(template_file), **ENGINE) as llm:
        assert llm.tokenizer.chat_template == TEMPLATE
        out = llm.chat(CHAT, params)[0]
    assert out.prompt_token_ids == raw.prompt_token_ids  # the template's rendering, its marker
    assert out.prompt_token_ids[0] == 2  # <bos>, added once
    assert out.token_ids == raw.token_ids and len(out.token_ids) > 0 and out.text.strip()


def test_kvwise_generate_takes_a_chat_template_file(gemma3_path, template_file):
    cmd = [
        sys.executable,
        "-m",
        "kvwise.cli",
        "generate",
        "What is the capital of France?",
        "--model",
        str(gemma3_path),
        "--chat-template",
        str(template_file),
        "--max-tokens",
        "4",
        "--kv-cache-memory",
        "64MiB",
        "--kv-disk-path",
        "off",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"chat template: from '{template_file}'" in result.stderr
    # 22 tokens: <bos> and the rendering above (the raw prompt alone is 8)
    assert "[22 prompt tokens" in result.stderr, result.stderr
