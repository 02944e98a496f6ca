"""The paged KV pool: per layer and K/V, ``num_blocks`` blocks of ``block_size`` slots, one class
per KV format, chosen once at build by ``make_kv_cache`` from the format's name.

Block ``b`` of the core's pool is ``[:, :, b]`` here. Slot ``s`` (a token's place in the pool)
is block ``s // block_size``, offset ``s % block_size``. The layout, the storage format and the
bytes of one block come from a ``KVSpec`` (``core/kv_spec.py``, where the formats' layout facts
are registered); the tensors of each format are here:

- ``FloatKVCache`` (``floats.py``): float32 / bfloat16 / float16, cast to and from the compute
  dtype when they differ;
- ``Int8KVCache`` (``quantized.py``): codes and a scale per token and head in one byte run per
  block half;
- ``Int4KVCache`` (``int4.py``): keys sealed per block, open blocks' rows in staging slots
  (``staging.py``'s ``StagingSlots``: the bookkeeping, plain Python).

``PagedKVCache`` (``base.py``) is the interface they share. A new format registers its layout
facts (``kvwise.core.kv_spec.register_kv_format``) and its class here
(``register_kv_cache``); the engine then builds it for ``kv_cache_dtype=<name>``.
"""

from __future__ import annotations

import inspect

import torch

from kvwise.core.kv_spec import KVSpec, kv_format
from kvwise.worker.kv_cache.base import TORCH_DTYPES, PagedKVCache, first_if_consecutive
from kvwise.worker.kv_cache.floats import FloatKVCache
from kvwise.worker.kv_cache.int4 import Int4KVCache
from kvwise.worker.kv_cache.quantized import Int8KVCache, QuantizedKVCache
from kvwise.worker.kv_cache.staging import StagePlan, StagingSlots

__all__ = [
    "TORCH_DTYPES",
    "FloatKVCache",
    "Int4KVCache",
    "Int8KVCache",
    "PagedKVCache",
    "QuantizedKVCache",
    "StagePlan",
    "StagingSlots",
    "first_if_consecutive",
    "make_kv_cache",
    "register_kv_cache",
    "unregister_kv_cache",
]

_CLASSES: dict[str, type[PagedKVCache]] = {}


def register_kv_cache(name: str, cls: type[PagedKVCache]) -> None:
    """The tensor class of the pool format ``name`` (registered in ``core/kv_spec`` first,
    with the use ``"pool"``): ``cls(spec, num_blocks, compute_dtype, use_kernels)``."""
    if "pool" not in kv_format(name).uses:
        raise ValueError(f"kv format {name!r}: not registered as one the pool stores")
    if name in _CLASSES:
        raise ValueError(f"kv format {name!r}: a cache class is registered already")
    _CLASSES[name] = cls


def unregister_kv_cache(name: str) -> None:
    """Remove a class registered by ``register_kv_cache`` (tests of a toy format)."""
    _CLASSES.pop(name, None)


def make_kv_cache(
    spec: KVSpec,
    num_blocks: int,
    compute_dtype: torch.dtype | None = None,
    use_kernels: bool = True,
    device: torch.device | None = None,
) -> PagedKVCache:
    """The pool of ``spec``'s format with ``num_blocks`` blocks.

    Args:
        compute_dtype: the model's dtype (K/V in and out); None: the storage dtype of a float
            format, float32 for a quantized one.
        use_kernels: kvwise's C++ kernels for writes and attention where they are built;
            False: the plain-torch paths (the same results; tests compare the two).
        device: where the pool lies (None: the CPU); the class is then given ``device=``.

    Raises:
        ValueError: a format the pool does not store (a size or an eval round trip only), or
            one that runs on the CPU only given another device.
    """
    cls = _CLASSES.get(spec.dtype)
    if cls is None:
        raise ValueError(f"kv_cache_dtype: the paged cache cannot hold {spec.layout}")
    if device is None or device.type == "cpu":  # a plug-in class need not know devices
        return cls(spec, num_blocks, compute_dtype, use_kernels)
    if cls.host_only or "device" not in inspect.signature(cls).parameters:
        raise ValueError(f"kv_cache_dtype: {spec.dtype} runs on the CPU only, not on {device}")
    return cls(spec, num_blocks, compute_dtype, use_kernels, device=device)


for _name in ("float32", "bfloat16", "float16"):
    register_kv_cache(_name, FloatKVCache)
register_kv_cache("int8", Int8KVCache)
register_kv_cache("int4", Int4KVCache)
del _name
