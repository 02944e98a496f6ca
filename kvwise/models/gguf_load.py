"""A GGUF's weights at the file's own precision, built one tensor at a time from the mapped file.

``quantization="auto"`` on a GGUF runs every linear weight, the embedding and the LM head in
the format its tensor has in the file, never below it:

- Q4_0 / Q4_1: kvwise's int4 blocks (``Int4Weight``), exactly;
- Q8_0: int8 blocks (``Q8Weight``), exactly;
- Q5_0, Q5_1, Q2_K .. Q6_K, MXFP4: ``BlockWeight`` (``gguf_blocks.py``), exactly;
- F32 / F16 / BF16: float32, exactly;
- any other type (IQ*, TQ*, ...): dequantized, then int8 blocks (Q8_0, 8.5 bits a weight)
  where the type has fewer bits than that, float32 otherwise ("converted" in the report).

The embedding and LM head take the same rule, except that Q4_0 / Q4_1 ones become int8
blocks (above their precision; the head's refinement needs exact rows, which int4 blocks do not
give). Each weight is built straight from its tensor's bytes in the memory map (numpy views,
no float copy of the model), the tensors in file order; a fused weight (q/k/v, gate/up) is
built once its parts are all read. Parts of one type are packed as one weight, parts of
different types (Q4_K_M mixes them) run side by side (``ConcatWeight``). The mapped pages of a
tensor are released once it is built, so the peak memory is the built weights plus one tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from kvwise.models import checkpoint
from kvwise.models.expert_stack import ExpertStack
from kvwise.models.gguf_blocks import SPECS, BlockWeight, ConcatWeight
from kvwise.models.gguf_pack import fast_pack
from kvwise.models.gguf_types import FLOATS as _FLOATS
from kvwise.models.gguf_types import runs_as
from kvwise.models.gguf_weights import as_hf_tensor, from_gguf_norm, hf_name
from kvwise.models.linear import float_mm
from kvwise.models.quant import QK, Int4Weight, Q8Weight, q4_groups

logger = logging.getLogger("kvwise")


@dataclass(frozen=True)
class WeightRow:
    """One line of the start-up report: the tensors of a GGUF type and what they run as."""

    gguf_type: str
    tensors: int
    runs_as: str  # "Q4_K (exact)", "Q8_0 (converted)", ...
    resident_bytes: int


class Float32Linear:
    """A float linear weight held `[in, out]` float32 (F32 / F16 / BF16 tensors, exactly)."""

    def __init__(self, weight: torch.Tensor) -> None:  # (out, in)
        self.weight = weight.float().t().contiguous()
        self.in_features, self.out_features = self.weight.shape

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return float_mm(x.float().contiguous(), self.weight)

    def dequantize(self) -> torch.Tensor:
        return self.weight.t()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def q8_groups(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `(out, in)` int8 and float32 scales `(out, in / 32)` of a Q8_0 tensor's blocks."""
    out_features, in_features = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    codes = blocks[:, 2:].view(np.int8).reshape(out_features, in_features)
    return torch.from_numpy(codes.copy()), torch.from_numpy(d.reshape(out_features, -1))


def build_weight(raw: np.ndarray, gguf_type: str, shape: tuple[int, int], head: bool = False):
    """The run-time weight of one `(out, in)` tensor's raw data (rows in HF order)."""
    how = runs_as(gguf_type, head)
    exact_int4 = gguf_type in ("Q4_0", "Q4_1") and not head
    if exact_int4 or gguf_type == "Q8_0" or gguf_type in SPECS:
        packed = fast_pack(raw, gguf_type, shape)  # one C++ pass, where the kernels are built
        if packed is not None:
            if exact_int4:
                return Int4Weight.from_packed(packed, *shape)
            if gguf_type == "Q8_0":
                return Q8Weight.from_packed(packed, *shape)
            return BlockWeight(SPECS[gguf_type], packed, *shape)
    if exact_int4:
        return Int4Weight(*q4_groups(raw, gguf_type, shape))
    if gguf_type == "Q8_0":
        return Q8Weight(*q8_groups(raw, shape))
    if gguf_type in SPECS:
        return BlockWeight.from_gguf(raw, gguf_type, shape)
    if how.startswith("Q8_0") and shape[1] % QK == 0:
        return _converted_q8(raw, gguf_type, shape)
    return Float32Linear(_dequantized(raw, gguf_type, shape))


def _dequantized(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> torch.Tensor:
    floats = dequantize(np.asarray(raw), gguf.GGMLQuantizationType[gguf_type])
    return torch.from_numpy(np.asarray(floats, np.float32)).reshape(shape)


_CONVERT_ROWS = 2048  # rows converted at a time: a float copy of a whole embedding is 400 MB


def _converted_q8(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> Q8Weight:
    """Int8 blocks of a tensor of another type, converted a slice of rows at a time."""
    rows, cols = shape
    parts = [
        Q8Weight.quantize(
            _dequantized(
                raw[at : at + _CONVERT_ROWS], gguf_type, (min(_CONVERT_ROWS, rows - at), cols)
            )
        ).packed
        for at in range(0, rows, _CONVERT_ROWS)
    ]
    return Q8Weight.from_packed(parts[0] if len(parts) == 1 else torch.cat(parts), rows, cols)


def _release(reader: gguf.GGUFReader, tensor: gguf.ReaderTensor | None = None) -> None:
    """Drop the mapped pages of ``tensor`` (None: of the whole file) from this process: the
    page cache keeps them, and a later read (the tokenizer's metadata) maps them again."""
    mapped = getattr(reader, "mmap", None)
    base = reader.data
    while mapped is None and base is not None:
        mapped = getattr(base, "_mmap", None)
        base = base.base
    if not isinstance(mapped, mmap.mmap):
        return
    start, end = (
        (0, len(mapped))
        if tensor is None
        else (tensor.data_offset, tensor.data_offset + tensor.n_bytes)
    )
    start -= start % mmap.PAGESIZE
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass  # only memory, never the result


@contextlib.contextmanager
def returned_to_the_system():
    """While loading, glibc's malloc hands every allocation of 1 MiB or more back to the system
    when it is freed (its default raises that bound as big blocks are freed, and keeps up to
    32 MiB blocks in its heap: the loader's temporaries would stay resident); afterwards the
    bound is 32 MiB and the heap is trimmed. A no-op where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    threshold = -3  # M_MMAP_THRESHOLD
    libc.mallopt(threshold, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(threshold, 32 << 20)
        libc.malloc_trim(0)


def _expert_slots(family, arch) -> dict[str, str]:
    """A mixture-of-experts layer's weight names within the layer -> their slot (none for a
    dense model): the stacked experts' ``gate`` / ``up`` / ``down`` and, where the model has a
    shared expert, ``shared_gate`` / ``shared_up`` / ``shared_down``."""
    names = family.expert_names
    if names is None or not arch.num_experts:
        return {}
    slots = {names.gate: "gate", names.up: "up", names.down: "down"}
    if names.shared is not None and arch.shared_expert_intermediate_size:
        slots.update(zip(names.shared, ("shared_gate", "shared_up", "shared_down"), strict=True))
    return slots


class GGUFWeightLoader:
    """Streams a GGUF's tensors into a ``CausalLM`` (see the module docstring)."""

    def __init__(self, model, reader: gguf.GGUFReader) -> None:
        self.model, self.reader, self.arch = model, reader, model.arch
        self.family = model.family
        self.permuted = str(reader.fields["general.architecture"].contents()) == "llama"
        # hf part name -> (layer, fused target); the parts each target waits for
        self.part_of: dict[str, tuple[int, str]] = {}
        for i in range(self.arch.num_layers):
            for target, parts in self.family.linear_parts.items():
                for part in parts:
                    self.part_of[f"{self.family.layer_prefix}{i}.{part}"] = (i, target)
        # a mixture of experts' tensors within a layer -> their slot ("gate", "shared_up", ...)
        self.expert_slot: dict[str, str] = _expert_slots(self.family, self.arch)
        self.experts: dict[int, dict[str, tuple]] = defaultdict(dict)  # layer -> slot -> part
        self.pending: dict[tuple[int, str], dict[str, tuple]] = defaultdict(dict)
        self.mapped: dict[tuple[int, str], list] = defaultdict(list)  # their tensors
        self.layers: dict[int, dict] = defaultdict(dict)
        self.rest: list[tuple[str, torch.Tensor]] = []
        self.heads: dict[str, object] = {}
        self.report: Counter = Counter()
        self.bytes: Counter = Counter()

    def load(self, tensors: Iterable[gguf.ReaderTensor]) -> list[WeightRow]:
        with returned_to_the_system():
            for tensor in tensors:
                name = hf_name(tensor.name, self.family)
                if name is not None:
                    self._take(name, tensor)
            self._finish()
        _release(self.reader)
        rows = [WeightRow(t, n, how, self.bytes[t, how]) for (t, how), n in self.report.items()]
        for row in rows:
            if row.runs_as.endswith("(converted)"):
                logger.warning(
                    "weights: %d %s tensors run as %s: no kernel holds %s exactly "
                    "(never below its precision)",
                    row.tensors,
                    row.gguf_type,
                    row.runs_as.split()[0],
                    row.gguf_type,
                )
        return rows

    def _raw(self, name: str, tensor: gguf.ReaderTensor) -> np.ndarray:
        """The tensor's rows (raw blocks or floats) in HF order (``gguf_weights`` on q / k)."""
        raw = tensor.data
        heads = self._rope_heads(name)
        if heads is None:
            return raw
        rows = raw.shape[0]  # llama.cpp's rows per head as interleaved pairs, undone
        return raw.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)

    def _rope_heads(self, name: str) -> int | None:
        if self.permuted and ".self_attn.q_proj." in name:
            return self.arch.num_heads
        if self.permuted and ".self_attn.k_proj." in name:
            return self.arch.num_kv_heads
        return None

    def _take(self, name: str, tensor: gguf.ReaderTensor) -> None:
        gguf_type = tensor.tensor_type.name
        shape = (int(tensor.shape[1]), int(tensor.shape[0])) if len(tensor.shape) == 2 else None
        family = self.family
        layer, _, within = name.removeprefix(family.layer_prefix).partition(".")
        if within in self.expert_slot and name.startswith(family.layer_prefix):
            self._take_expert(int(layer), within, tensor)
        elif name in self.part_of and shape is not None:
            layer, target = self.part_of[name]
            self.pending[layer, target][name] = (self._raw(name, tensor), gguf_type, shape)
            self.mapped[layer, target].append(tensor)
            self._count(gguf_type, runs_as(gguf_type))
            parts = family.linear_parts[target]
            waiting = self.pending[layer, target]
            if len(waiting) == len(parts):
                prefix = f"{family.layer_prefix}{layer}."
                self._build_fused(layer, target, [waiting.pop(prefix + p) for p in parts])
                del self.pending[layer, target]
                for part in self.mapped.pop((layer, target)):  # read again while building
                    _release(self.reader, part)
        elif name in (family.embed_name, family.lm_head_name) and gguf_type not in _FLOATS:
            tied = self.arch.tie_word_embeddings
            if name == family.lm_head_name and tied:
                return
            how = runs_as(gguf_type, head=True)
            weight = build_weight(self._raw(name, tensor), gguf_type, shape, head=True)
            self.heads[name] = weight
            self._count(gguf_type, how, weight.nbytes)
        else:
            floats = self._float(name, tensor)  # norms, biases (a float embedding): exact
            if "{e}" in name:  # every expert's bias in one tensor (E, out): one each
                self.rest += [(name.format(e=e), floats[e]) for e in range(len(floats))]
            else:
                self.rest.append((name, floats))
            self._count(gguf_type, "float32 (exact)", floats.nbytes * self._copies(name))
        _release(self.reader, tensor)

    def _copies(self, name: str) -> int:
        """How many times the model holds a float tensor: a q / k norm once a head (the
        decoder's fused ``qk_norm``), anything else once."""
        within = name.partition(".layers.")[2].partition(".")[2]
        q_name, k_name = self.family.qk_norm_names
        return {q_name: self.arch.num_heads, k_name: self.arch.num_kv_heads}.get(within, 1)

    def _float(self, name: str, tensor: gguf.ReaderTensor) -> torch.Tensor:
        """A small tensor (a norm, a bias; a float embedding) dequantized, rows in HF order
        (a norm as the HF checkpoint holds it: ``gguf_weights.from_gguf_norm``)."""
        raw = np.asarray(dequantize(self._raw(name, tensor), tensor.tensor_type), np.float32)
        floats = torch.from_numpy(raw.reshape(tuple(int(d) for d in reversed(tensor.shape))).copy())
        return as_hf_tensor(self.family, name, from_gguf_norm(self.family, name, floats))

    def _count(self, gguf_type: str, how: str, nbytes: int = 0) -> None:
        self.report[gguf_type, how] += 1
        self.bytes[gguf_type, how] += nbytes

    def _take_expert(self, layer: int, within: str, tensor: gguf.ReaderTensor) -> None:
        """Keep a mixture-of-experts tensor (``(E, out, in)`` stacked, or the shared expert's
        ``(out, in)``) until its layer has them all, then build each expert's weights."""
        gguf_type = tensor.tensor_type.name
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # each expert's (out, in)
        self.experts[layer][self.expert_slot[within]] = (tensor.data, gguf_type, shape)
        self.mapped[layer, "experts"].append(tensor)
        self._count(gguf_type, runs_as(gguf_type))
        parts = self.experts[layer]
        if len(parts) < len(set(self.expert_slot.values())):
            return
        del self.experts[layer]
        moe = self.model.layers[layer].moe

        def slab(slot: str, e: int | None) -> tuple:
            raw, kind, size = parts[slot]
            return (raw if e is None else raw[e], kind, size)

        stacks = self._stacked(parts, moe.num_experts)
        if stacks is not None:  # every expert a view of the stacks
            pairs = [(stacks[0].expert(e), stacks[1].expert(e)) for e in range(moe.num_experts)]
        else:
            pairs = [
                (self._fused([slab("gate", e), slab("up", e)]), self._fused([slab("down", e)]))
                for e in range(moe.num_experts)
            ]
        if "shared_gate" in parts:
            gate_up = self._fused([slab("shared_gate", None), slab("shared_up", None)])
            pairs.append((gate_up, self._fused([slab("shared_down", None)])))
        moe.install_experts(pairs, stacks)
        for part in self.mapped.pop((layer, "experts")):
            _release(self.reader, part)

    def _stacked(self, parts: dict[str, tuple], num: int) -> tuple | None:
        """The routed experts' gate_up and down as ``ExpertStack``s, each stacked tensor packed
        in one pass (its ``E * out`` rows as one weight's: the same bytes as packing expert by
        expert, without the per-expert calls and the stacking copy); None where a part's type
        has no block kernel (Q4_0, Q8_0: built expert by expert) or the kernels are absent."""
        stacked = {}
        for slot in ("gate", "up", "down"):
            raw, kind, (rows, cols) = parts[slot]
            if kind not in SPECS or rows % 8:
                return None
            packed = fast_pack(raw, kind, (num * rows, cols))
            if packed is None:
                return None
            stacked[slot] = (SPECS[kind], packed.view(num, rows // 8, *packed.shape[1:]), rows)
            self.bytes[kind, runs_as(kind)] += packed.nbytes
        gate, up, down = stacked["gate"], stacked["up"], stacked["down"]
        if gate[0] == up[0]:  # one type: [gate | up] rows of each expert as one weight
            gate_up = [(gate[0], torch.cat((gate[1], up[1]), dim=1), gate[2] + up[2])]
        else:  # two types: side by side, as ConcatWeight runs them
            gate_up = [gate, up]
        return ExpertStack(gate_up, parts["gate"][2][1]), ExpertStack([down], parts["down"][2][1])

    def _build_fused(self, layer: int, target: str, parts: list[tuple]) -> None:
        """One weight of the parts, installed once its layer has all of its own."""
        self.layers[layer][target] = self._fused(parts)
        wanted = len(self.family.linear_parts) if self.model.layers[layer].moe is None else 2
        if len(self.layers[layer]) == wanted:  # a mixture of experts': its attention's two
            self.model.layers[layer].install_quantized(self.layers.pop(layer))

    def _fused(self, parts: list[tuple]):
        """One weight of ``parts`` (raw, GGUF type, (out, in)), rows stacked in their order;
        runs of neighbouring parts of one type packed as one."""
        runs: list[list[tuple]] = []
        for part in parts:
            same = runs and runs[-1][-1][1] == part[1] and runs[-1][-1][2][0] % 8 == 0
            if same:
                runs[-1].append(part)
            else:
                runs.append([part])
        built = []
        for run in runs:
            gguf_type = run[0][1]
            raw = run[0][0] if len(run) == 1 else np.concatenate([np.asarray(r) for r, _, _ in run])
            shape = (sum(s[0] for _, _, s in run), run[0][2][1])
            built.append(build_weight(raw, gguf_type, shape))
            self.bytes[gguf_type, runs_as(gguf_type)] += built[-1].nbytes
        return built[0] if len(built) == 1 else ConcatWeight(built)

    def _finish(self) -> None:
        family, model = self.family, self.model
        if self.pending or self.layers or self.experts:
            missing = sorted(n for parts in self.pending.values() for n in parts) or sorted(
                f"layer {i}" for i in {*self.layers, *self.experts}
            )
            raise ValueError(f"weights: the file lacks parts of fused weights, e.g. {missing[:3]}")
        checkpoint.load_weights(model, self.rest, quantized=True)
        embed = self.heads.get(family.embed_name)
        tied = self.arch.tie_word_embeddings
        head = embed if tied else self.heads.get(family.lm_head_name)
        model.install_heads(embed, head)
