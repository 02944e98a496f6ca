"""Read a GGUF file's tensors as Hugging Face-named, HF-layout float tensors.

llama.cpp's converter permutes the rows of q/k (weights and biases) of `llama`-architecture
models so that its interleaved ("GPT-J") rope can be applied; we undo that permutation so the
model uses the HF rotate_half convention for every source. qwen2/qwen3 and gemma2/gemma3 GGUFs
use llama.cpp's NEOX rope and are stored unpermuted.

Names: a GGUF norm lands on the family's slot of it (``ModelFamily.norm_names``: llama.cpp's
``ffn_norm`` is Llama's post_attention_layernorm but Gemma's pre_feedforward_layernorm, and its
``post_attention_norm`` / ``post_ffw_norm`` are Gemma's post-norms); the top-level tensors take
the family's names. llama.cpp's converter adds 1 to every Gemma norm weight (HF's GemmaRMSNorm
scales by ``1 + w``); the loader subtracts the family's ``gguf_norm_offset`` again, in float32
as transformers' GGUF loader does, so both compute the same ``1 + w``.

GGUF lists a tensor's dims innermost first (`[in, out]` for a matrix); numpy order is the
reverse, which is the HF `[out, in]` layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from kvwise.models.arch import ModelArchConfig
from kvwise.models.family import LlamaFamily, ModelFamily
from kvwise.models.gguf_file import GGUFFile
from kvwise.models.quant import q4_groups
from kvwise.models.registry import family_for

NATIVE_INT4 = ("Q4_0", "Q4_1")  # GGUF types that map exactly onto the int4 kernel's groups

_TOP_LEVEL = {  # GGUF name -> the family's attribute naming its HF tensor
    "token_embd.weight": "embed_name",
    "output_norm.weight": "final_norm_name",
    "output.weight": "lm_head_name",
}
_NORM_SLOTS = {  # a layer's GGUF norm -> its slot in ModelFamily.norm_names
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_attention_norm.weight": "attn_out_norm",
    "post_ffw_norm.weight": "mlp_out_norm",
}
_PER_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# a mixture-of-experts layer's tensors -> the ExpertNames field naming their HF tensor; the
# three ``_exps`` tensors stack every expert (``(E, out, in)`` in numpy order) and are split
EXPERT_TENSORS = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
    "ffn_gate_inp_shexp.weight": "shared_scale",
    "ffn_gate_inp.bias": "router_bias",  # gpt-oss's biases
    "ffn_gate_exps.bias": "gate_bias",
    "ffn_up_exps.bias": "up_bias",
    "ffn_down_exps.bias": "down_bias",
}
SHARED_EXPERT_TENSORS = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
# Carried in the arch config (rope_freqs) rather than as a weight.
_SKIPPED = {"rope_freqs.weight"}


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file for reading: metadata parsed (milliseconds; string arrays decoded on
    first use), tensor data memory-mapped. A `gguf.GGUFReader` (``models/gguf_file.py``).

    Raises:
        ValueError: (naming the file) not a little-endian GGUF v2/v3, or corrupt.
    """
    return GGUFFile(path)


def hf_name(gguf_name: str, family: type[ModelFamily] = LlamaFamily) -> str | None:
    """``family``'s HF name for a GGUF tensor name; None for tensors that are not weights
    (rope_freqs).

    Raises:
        ValueError: a name this loader does not know (or a norm the family does not have).
    """
    if gguf_name in _TOP_LEVEL:
        return getattr(family, _TOP_LEVEL[gguf_name])
    if gguf_name in _SKIPPED:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        slot = family.gguf_norm_slots.get(parts[2]) or _NORM_SLOTS.get(parts[2], "")
        within = _PER_LAYER.get(parts[2]) or family.norm_names.get(slot)
        within = within or _expert_name(parts[2], family)
        if within is not None:
            return f"{family.layer_prefix}{parts[1]}.{within}"
    raise ValueError(f"weights: unexpected GGUF tensor '{gguf_name}'")


def _expert_name(within: str, family: type[ModelFamily]) -> str | None:
    """A MoE tensor's HF name within its layer (the ``_exps`` ones with ``{e}`` left for the
    expert's index), or None."""
    names = family.expert_names
    if names is None:
        return None
    if within in EXPERT_TENSORS:
        return getattr(names, EXPERT_TENSORS[within])
    if within in SHARED_EXPERT_TENSORS and names.shared is not None:
        return names.shared[SHARED_EXPERT_TENSORS.index(within)]
    return None


def from_gguf_norm(family: type[ModelFamily], name: str, floats: torch.Tensor) -> torch.Tensor:
    """``floats`` of the HF tensor ``name`` as the HF checkpoint holds it: a norm weight less
    the ``gguf_norm_offset`` llama.cpp added (float32, in place); any other tensor as it is."""
    if family.gguf_norm_offset and name.endswith("norm.weight"):
        return floats.sub_(family.gguf_norm_offset)
    return floats


def as_hf_tensor(family: type[ModelFamily], name: str, floats: torch.Tensor) -> torch.Tensor:
    """``floats`` in the HF tensor's shape: the shared expert's scalar gate, a vector in a
    GGUF, is ``(1, hidden)`` in HF; any other tensor as it is."""
    scale = getattr(family.expert_names, "shared_scale", None)
    if floats.dim() == 1 and scale and name.endswith("." + scale):
        return floats.unsqueeze(0)
    return floats


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rows grouped per head as interleaved pairs).

    llama.cpp stores `w.reshape(n, 2, d // n // 2, *rest).swapaxes(1, 2).reshape(w.shape)`;
    this returns the original HF rows. Works for weights `(rows, in)` and biases `(rows,)`.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (n, d/2, 2, ...)
    return w.transpose(1, 2).reshape(weight.shape)  # (rows, ...)


def tensor_to_torch(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor in numpy (HF) dim order."""
    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF dims are innermost-first
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # a view of the read-only mapping (F32 tensors)
        array = array.copy()
    return torch.from_numpy(array)


def iter_gguf_weights(
    reader: gguf.GGUFReader,
    arch: ModelArchConfig,
    tensors: Iterable[gguf.ReaderTensor] | None = None,
    native_int4: Iterable[str] = (),
) -> Iterator[tuple[str, torch.Tensor | tuple[torch.Tensor, ...]]]:
    """Yield `(hf_name, float32 tensor)` for every weight in `reader`.

    `tensors` (default `reader.tensors`) lets the caller wrap them, e.g. in a progress bar.
    Tensors named in `native_int4` that are Q4_0 / Q4_1 come as int4 groups instead:
    `(codes, scales, mins)` (``quant.q4_groups``), rows in HF order like the floats.

    Raises:
        ValueError: an unknown tensor name.
    """
    gguf_arch = str(reader.fields["general.architecture"].contents())
    permuted = gguf_arch == "llama"
    family = family_for(arch.architecture)
    native = set(native_int4)
    for tensor in reader.tensors if tensors is None else tensors:
        name = hf_name(tensor.name, family)
        if name is None:
            continue
        if name in native and tensor.tensor_type.name in NATIVE_INT4:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # (out, in)
            parts = q4_groups(tensor.data, tensor.tensor_type.name, shape)
            yield name, tuple(_unpermuted(name, part, arch, permuted) for part in parts)
            continue
        floats = from_gguf_norm(family, name, tensor_to_torch(tensor))
        if "{e}" in name:  # every expert's weight in one tensor (E, out, in): one each
            for e in range(floats.shape[0]):
                yield name.format(e=e), floats[e]
            continue
        yield name, _unpermuted(name, as_hf_tensor(family, name, floats), arch, permuted)


def _unpermuted(name: str, rows: torch.Tensor, arch: ModelArchConfig, permuted: bool):
    if permuted and ".self_attn.q_proj." in name:
        return unpermute_rope_rows(rows, arch.num_heads)
    if permuted and ".self_attn.k_proj." in name:
        return unpermute_rope_rows(rows, arch.num_kv_heads)
    return rows
