"""Load a model from a Hugging Face directory (config.json + safetensors) or a GGUF file.

`load_model(None)` loads the default model (SmolLM2-135M-Instruct, Q4_1 GGUF). The model is the
decoder of the architecture's family (``models/registry.py``). With ``quantization="none"``
GGUF weights are dequantized to `dtype` at load time; "int4" / "int8" (and "auto" on a GGUF)
install quantized linear weights (``models/quant.py``), whose layers then run the fastest
``LayerOps`` that can compute them (``models/layer_ops.py``).

The fingerprint identifies the weights a KV cache was computed with (two processes may share
cached blocks only if their fingerprints match). It is a sha256 over: the format, the dtype, the
config.json bytes (HF), and for every weight file its size plus the sha256 of its first, middle
and last MiB. It ignores paths and mtimes, so a copied file keeps its fingerprint; it costs a
few MiB of reads however large the model is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from kvwise.config import QUANTIZATIONS
from kvwise.models import checkpoint
from kvwise.models.arch import ModelArchConfig
from kvwise.models.arch_load import arch_from_gguf, arch_from_hf_config
from kvwise.models.decoder import CausalLM
from kvwise.models.default import default_model_path
from kvwise.models.family import ModelFamily
from kvwise.models.gguf_load import GGUFWeightLoader, WeightRow
from kvwise.models.gguf_weights import iter_gguf_weights, open_gguf
from kvwise.models.layer_weights import LINEAR_NAMES
from kvwise.models.quant import Int4Weight, Int8Weight, Q8Weight, QuantWeight

_SAMPLE_BYTES = 1 << 20
_T = TypeVar("_T")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it.

    fingerprint: hex sha256 of the weights' identity and dtype (see the module docstring).
    generation_config: generation_config.json of an HF directory; empty for GGUF.
    """

    model: CausalLM
    arch: ModelArchConfig
    source: Path
    fingerprint: str
    generation_config: dict[str, Any] = field(default_factory=dict)
    is_gguf: bool = False
    gguf_reader: Any = None  # the open GGUF, so the tokenizer need not parse it again
    weight_format: str = "none"  # "none" (float `dtype`), "int4", "int8" or "gguf"
    # "gguf": what each GGUF type's tensors run as (``gguf_load.WeightRow``), for the start-up
    weight_report: list = field(default_factory=list)


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    quantization: str | None = "none",
    device: torch.device | None = None,
) -> LoadedModel:
    """Load the weights at `path` into a `CausalLM` of the architecture's family, in eval mode.

    Args:
        path: an HF model directory, a `.gguf` file, a directory holding exactly one `.gguf`,
            or None for the default model.
        dtype: parameter dtype (float32, bfloat16 or float16).
        progress: show a tqdm bar over tensors.
        quantization: "none" (or None) dequantizes every weight to `dtype`; "auto" runs a
            quantized GGUF on quantized kernels and an HF checkpoint in `dtype`; "int8" /
            "int4" quantize the linear weights at load.
        device: where the weights live (None: the CPU); read on the host, then moved. Off
            the CPU they are float (``worker/device.py``): "auto" means "none" there.

    Raises:
        ValueError: the path does not exist or holds no model; the architecture, rope type
            or a tensor is not supported; weights are missing or misshapen.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    quantization = "none" if quantization is None else quantization
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {quantization!r}")
    if device is not None and device.type != "cpu":
        if quantization not in ("none", "auto"):
            raise ValueError(f"quantization: {quantization!r} runs on the CPU only, not {device}")
        loaded = load_model(path, dtype, progress, "none")
        return replace(loaded, model=loaded.model.to_device(device))
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ValueError(f"model: path '{source}' does not exist")
    if source.is_dir():
        if (source / "config.json").is_file():
            return _load_hf_dir(source, dtype, progress, quantization)
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) != 1:
            found = "no .gguf file" if not ggufs else f"{len(ggufs)} .gguf files; pass one"
            raise ValueError(f"model: directory '{source}' has no config.json and {found}")
        source = ggufs[0]
    if source.suffix != ".gguf":
        raise ValueError(f"model: '{source}' is neither a model directory nor a .gguf file")
    return _load_gguf(source, dtype, progress, quantization)


def _load_gguf(path: Path, dtype: torch.dtype, progress: bool, quantization: str) -> LoadedModel:
    reader = open_gguf(path)
    arch = arch_from_gguf(reader)
    model = CausalLM(arch, dtype)
    tensors = _progress(reader.tensors, len(reader.tensors), path.name, progress)
    report: list[WeightRow] = []
    if quantization == "auto":  # every tensor at its own type's precision (gguf_load.py)
        report = GGUFWeightLoader(model, reader).load(tensors)
        weight_format = _auto_format(model)
    elif arch.num_experts:  # experts read as floats, then kept or quantized
        checkpoint.load_weights(model, iter_gguf_weights(reader, arch, tensors))
        if quantization != "none":
            _quantize_loaded(model, quantization)
        weight_format = quantization
    elif quantization == "int4":  # Q4_0 / Q4_1 map onto the kernel as they are
        family = model.family
        linear = {
            f"{family.layer_prefix}{i}.{part}"
            for i in range(arch.num_layers)
            for part in _linear_suffixes(family)
        }
        _load_quantized(model, iter_gguf_weights(reader, arch, tensors, linear), "int4")
        weight_format = "int4"
    else:
        checkpoint.load_weights(model, iter_gguf_weights(reader, arch, tensors))
        if quantization == "int8":
            _quantize_loaded(model, "int8")
        weight_format = quantization
    fingerprint = _fingerprint(
        f"gguf+{_FORMAT_TAGS.get(weight_format, weight_format)}", dtype, [path], b""
    )
    return LoadedModel(
        model.eval(),
        arch,
        path,
        fingerprint,
        {},
        is_gguf=True,
        gguf_reader=reader,
        weight_format=weight_format,
        weight_report=report,
    )


def _auto_format(model: CausalLM) -> str:
    """ "int4" where every linear weight is int4 blocks (a Q4_0 / Q4_1 file: the arithmetic of
    ``quantization="int4"``), else "gguf" (each tensor in its own type)."""
    linear = [w for layer in model.layers for w in (layer.quant or {}).values()]
    linear += [
        w for layer in model.layers if layer.moe for pair in layer.moe.quant or () for w in pair
    ]
    return "int4" if linear and all(isinstance(w, Int4Weight) for w in linear) else "gguf"


def _linear_suffixes(family: type[ModelFamily]) -> set[str]:
    """The HF names of a layer's linear weights, within the layer."""
    return {part for parts in family.linear_parts.values() for part in parts}


def _load_quantized(model: CausalLM, weights, weight_format: str) -> None:
    """Load norms and biases as floats and everything else quantized to ``weight_format``
    (int4 groups that come as such are kept as they are)."""
    arch, family = model.arch, model.family
    linear = _linear_suffixes(family)
    big: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    rest = []
    for name, weight in weights:
        within = name[len(family.layer_prefix) :].partition(".")[2]
        in_layer = name.startswith(family.layer_prefix) and within in linear
        if in_layer or name in (family.embed_name, family.lm_head_name):
            big[name] = weight
        else:
            rest.append((name, weight))
    checkpoint.load_weights(model, rest, quantized=True)
    layers = []
    for i in range(arch.num_layers):
        prefix = f"{family.layer_prefix}{i}."
        layers.append(
            {
                target: _fuse([big.pop(prefix + part) for part in parts], weight_format)
                for target, parts in family.linear_parts.items()
            }
        )
    embed = Q8Weight.quantize(big.pop(family.embed_name))
    tied = arch.tie_word_embeddings
    head = embed if tied else Q8Weight.quantize(big.pop(family.lm_head_name))
    model.install_quantized(layers, embed, head)


def _quantize_loaded(model: CausalLM, weight_format: str) -> None:
    """Quantize a loaded float model's linear weights (a mixture of experts': each expert's),
    embedding and LM head (latent attention's layers: their own projections, ``mla.py``)."""
    embed = Q8Weight.quantize(model.embed)
    tied = model.arch.tie_word_embeddings
    head = embed if tied else Q8Weight.quantize(model.lm_head.t())
    if model.arch.kv_lora_rank:
        for layer in model.layers:
            layer.install_quantized(lambda w: _fuse([w], weight_format))
        model.install_heads(embed, head)
        return
    layers = []
    for layer in model.layers:
        names = LINEAR_NAMES
        if layer.moe is not None:
            layer.moe.install_quantized(lambda w: _fuse([w], weight_format))
            names = ("qkv_proj", "o_proj")
        layers.append({name: _fuse([getattr(layer, name).t()], weight_format) for name in names})
    model.install_quantized(layers, embed, head)


def _fuse(parts: list, weight_format: str) -> QuantWeight:
    """One quantized weight from the row blocks of a fused weight: float tensors `(out, in)`
    or int4 blocks `(codes, scales, mins)`."""
    if weight_format == "int4" and all(isinstance(p, tuple) for p in parts):
        codes, scales, mins = (torch.cat(column) for column in zip(*parts))
        return Int4Weight(codes, scales, mins)
    floats = torch.cat([_dequantized(p) for p in parts])
    if weight_format == "int4":
        return Int4Weight.quantize(floats)
    return Int8Weight.quantize(floats)


def _dequantized(part) -> torch.Tensor:
    if not isinstance(part, tuple):
        return part
    codes, scales, mins = part
    group = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.repeat_interleave(group, 1) + mins.repeat_interleave(group, 1)


def _load_hf_dir(
    directory: Path, dtype: torch.dtype, progress: bool, quantization: str
) -> LoadedModel:
    config_bytes = (directory / "config.json").read_bytes()
    arch = arch_from_hf_config(json.loads(config_bytes))
    files = _safetensors_files(directory)
    model = CausalLM(arch, dtype)
    tensors = _iter_safetensors(files, directory.name, progress)
    split = model.family.hf_tensors
    checkpoint.load_weights(model, (pair for name, t in tensors for pair in split(name, t)))
    weight_format = "none" if quantization == "auto" else quantization  # auto: its own dtype
    if weight_format != "none":
        _quantize_loaded(model, weight_format)
    generation_config: dict[str, Any] = {}
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        generation_config = json.loads(gen_path.read_text())
    fingerprint = _fingerprint(
        f"hf+{_FORMAT_TAGS.get(weight_format, weight_format)}", dtype, files, config_bytes
    )
    return LoadedModel(
        model.eval(),
        arch,
        directory,
        fingerprint,
        generation_config,
        False,
        weight_format=weight_format,
    )


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those in the shard index, else all but consolidated*.

    Mistral repos also ship `consolidated.safetensors` in another naming scheme; it is skipped.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"model: shards listed in {index.name} are missing: {absent}")
        return files
    files = [f for f in sorted(directory.glob("*.safetensors")) if "consolidated" not in f.name]
    if not files:
        raise ValueError(f"model: directory '{directory}' has config.json but no .safetensors")
    return files


def _iter_safetensors(
    files: list[Path], label: str, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(handle, name) for handle in handles for name in handle.keys()]
    for handle, name in _progress(keys, len(keys), label, progress):
        yield name, handle.get_tensor(name)


def _progress(items: Iterable[_T], total: int, label: str, enabled: bool) -> Iterable[_T]:
    return tqdm(items, total=total, desc=f"Loading {label}", unit="tensor", disable=not enabled)


# what a format's arithmetic is, in the fingerprint (and so in the prefix-cache hash root and
# every tier entry): KV computed by an older arithmetic (int4 with bfloat16 activations, an
# embedding with one scale per row) never loads
_FORMAT_TAGS = {"int4": "int4-q8act", "int8": "int8-q8head", "gguf": "gguf-native-q8act"}


def _fingerprint(kind: str, dtype: torch.dtype, files: list[Path], config: bytes) -> str:
    digest = hashlib.sha256()
    digest.update(f"{kind}|{dtype}|".encode())
    digest.update(hashlib.sha256(config).digest())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{size}|".encode())
        with path.open("rb") as f:
            for offset in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                digest.update(hashlib.sha256(f.read(_SAMPLE_BYTES)).digest())
    return digest.hexdigest()
