"""Hugging Face tensor names -> the decoder's fused parameters, as the model's family names them.

A layer's tensors go into its fused parameters (``models/decoder.py``): q/k/v into column
ranges of ``qkv_proj`` (and of ``qkv_bias``), gate/up into ``gate_up_proj``, the q and k norms
into rows of ``qk_norm``, each linear weight transposed from HF's `[out, in]` into `[in, out]`.
The names come from the family (``ModelFamily.norm_names``, ``linear_parts``,
``qk_norm_names``, the top-level names), so a family with other names or extra norms needs no
code here. GGUF tensors arrive already renamed to HF's names (``models/gguf_weights.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvwise.models.decoder import CausalLM
from kvwise.models.layer_weights import LayerWeights
from kvwise.models.mla import MLALayer

Slot = tuple[torch.Tensor | None, bool]  # (a view of a parameter, whether to transpose into it)


def layer_slots(layer: LayerWeights) -> dict[str, Slot]:
    """Where each HF tensor of ``layer`` goes, by its name within the layer (e.g.
    ``self_attn.q_proj.weight``). A linear part's view is None once the layer is quantized."""
    family = layer.family
    if isinstance(layer, MLALayer):  # latent attention: its own weights (models/mla.py)
        slots = layer.slots()
        if layer.moe is not None:
            slots.update(_expert_slots(layer))
        return slots
    slots: dict[str, Slot] = {
        suffix: (getattr(layer, name), False) for name, suffix in family.norm_names.items()
    }
    sizes = layer.part_sizes()
    for fused, parts in family.linear_parts.items():
        weight, start = getattr(layer, fused), 0  # [in, out]
        if weight is None and layer.moe is not None and fused in ("gate_up_proj", "down_proj"):
            continue  # a mixture of experts in the dense MLP's place: its own slots below
        for part, size in zip(parts, sizes[fused], strict=True):
            slots[part] = (None if weight is None else weight[:, start : start + size], True)
            start += size
    if layer.qkv_bias is not None:
        start = 0
        for part, size in zip(family.linear_parts["qkv_proj"], sizes["qkv_proj"], strict=True):
            slots[_bias_name(part)] = (layer.qkv_bias[start : start + size], False)
            start += size
    if layer.o_bias is not None:
        slots[_bias_name(family.linear_parts["o_proj"][0])] = (layer.o_bias, False)
    if layer.qk_norm is not None:
        q_name, k_name = family.qk_norm_names
        slots[q_name] = (layer.qk_norm[: layer.num_heads], False)
        slots[k_name] = (layer.qk_norm[layer.num_heads :], False)
    if layer.sinks is not None:
        slots[family.sinks_name] = (layer.sinks, False)
    if layer.moe is not None:
        slots.update(_expert_slots(layer))
    return slots


def _expert_slots(layer: LayerWeights) -> dict[str, Slot]:
    """A mixture-of-experts layer's tensors (``models/moe.py``), by the family's names."""
    names, moe = layer.family.expert_names, layer.moe
    if names is None:
        raise ValueError(f"family {layer.family.__name__}: names no expert tensors")
    inter = moe.inter
    slots: dict[str, Slot] = {names.router: (moe.router, True)}
    for e in range(moe.num_experts if moe.gate_up is not None else 0):  # none once installed
        slots[names.gate.format(e=e)] = (moe.gate_up[e][:, :inter], True)
        slots[names.up.format(e=e)] = (moe.gate_up[e][:, inter:], True)
        slots[names.down.format(e=e)] = (moe.down[e], True)
    if moe.shared_gate_up is not None and names.shared is not None:
        gate, up, down = names.shared
        s = moe.shared_inter
        slots[gate] = (moe.shared_gate_up[:, :s], True)
        slots[up] = (moe.shared_gate_up[:, s:], True)
        slots[down] = (moe.shared_down, True)
    if moe.shared_gate is not None and names.shared_scale is not None:
        slots[names.shared_scale] = (moe.shared_gate, True)
    if moe.router_bias is not None:
        slots[names.router_bias] = (moe.router_bias, False)
    if moe.correction_bias is not None:
        slots[names.correction_bias] = (moe.correction_bias, False)
    if moe.gate_up_bias is not None:  # floats whatever the experts' format
        for e in range(moe.num_experts):
            slots[names.gate_bias.format(e=e)] = (moe.gate_up_bias[e][:inter], False)
            slots[names.up_bias.format(e=e)] = (moe.gate_up_bias[e][inter:], False)
            slots[names.down_bias.format(e=e)] = (moe.down_bias[e], False)
    return slots


def _bias_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + "bias"


class _Slots:
    """Name -> slot for a whole model, each layer's table built once."""

    def __init__(self, model: CausalLM) -> None:
        family = model.family
        self.model, self.prefix = model, family.layer_prefix
        self.top: dict[str, Slot] = {
            family.embed_name: (model.embed, False),
            family.final_norm_name: (model.norm, False),
            family.lm_head_name: (model.lm_head, True),
        }
        self.layers: dict[int, dict[str, Slot]] = {}

    def find(self, name: str) -> tuple[torch.Tensor, bool]:
        slot = self.top.get(name)
        if slot is None and name.startswith(self.prefix):
            index, _, suffix = name[len(self.prefix) :].partition(".")
            if index.isdigit():
                slot = self._layer(int(index), name).get(suffix)
        if slot is None or slot[0] is None:
            raise ValueError(f"weights: unexpected tensor '{name}'")
        return slot  # type: ignore[return-value]

    def _layer(self, layer_idx: int, name: str) -> dict[str, Slot]:
        layers = self.model.layers
        if layer_idx >= len(layers):
            raise ValueError(f"weights: '{name}' is past num_layers={len(layers)}")
        if layer_idx not in self.layers:
            self.layers[layer_idx] = layer_slots(layers[layer_idx])  # type: ignore[arg-type]
        return self.layers[layer_idx]


def load_weights(
    model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], quantized: bool = False
) -> None:
    """Copy Hugging Face-named, HF-layout (`[out, in]`) tensors into the fused parameters.

    With tied embeddings the LM head's tensor is ignored and `lm_head` is copied from `embed`.
    ``quantized``: only the weights ``install_quantized`` does not replace (norms, biases).

    Raises:
        ValueError: an unknown name, a shape mismatch, or weights missing at the end.
    """
    family, tied = model.family, model.arch.tie_word_embeddings
    slots, loaded = _Slots(model), set()
    for name, tensor in weights:
        if name.endswith(family.ignored_suffixes) or (tied and name == family.lm_head_name):
            continue
        dst, transpose = slots.find(name)
        src = tensor.t() if transpose else tensor
        if src.dim() == 1 and dst.dim() == 2 and dst.shape[1:] == src.shape:
            pass  # a per-head norm weight broadcast over its rows of the fused qk_norm
        elif dst.shape != src.shape:
            raise ValueError(
                f"weights: '{name}' has shape {tuple(tensor.shape)}, expected "
                f"{tuple(dst.t().shape if transpose else dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(src)
        loaded.add(name)
    missing = sorted(set(expected_weight_names(model, quantized)) - loaded)
    if missing:
        raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for layer in model.layers:  # a layer that reorders what it loaded (mla.py's rotary)
        if hasattr(layer, "after_load"):
            layer.after_load()
    if tied and not quantized:
        with torch.no_grad():
            model.lm_head.copy_(model.embed.t())


def expected_weight_names(model: CausalLM, quantized: bool = False) -> list[str]:
    """HF names `load_weights` needs (biases and norms only where the arch has them);
    ``quantized``: without the linear weights, the embedding and the LM head."""
    family = model.family
    names = [family.final_norm_name]
    if not quantized:
        names.append(family.embed_name)
        if not model.arch.tie_word_embeddings:
            names.append(family.lm_head_name)
    linear = {part for parts in family.linear_parts.values() for part in parts}
    for i, layer in enumerate(model.layers):
        suffixes = layer_slots(layer)  # type: ignore[arg-type]
        names += [
            f"{family.layer_prefix}{i}.{s}" for s in suffixes if not (quantized and s in linear)
        ]
    return names
