"""The model runner's contract: what the engine (``LLMEngine``, ``assemble.py``, the KV
loader) asks of whatever runs the model, as a protocol. Pure Python: it names no tensor.

``worker.model_runner.ModelRunner`` (torch) and ``worker.fake_runner.FakeModelRunner`` (no
torch, for tests) implement it structurally. Everything crossing it is plain data
(``SchedulerOutput`` in, ``ModelOutput`` out, ``core/outputs.py``) or bytes laid out as the
runner's ``KVSpec`` says.

Block copies for the tiers: a *payload* is the K/V of a run of device blocks laid out
``(layers, 2, num_blocks, block half bytes)``, the layout of a stored entry's payload. A
stored entry (one layer group of a chunk) may start before the blocks a load wants: ``skip``
of its ``num_entry_blocks`` blocks come first and are not copied. ``layers`` is the group's
``(first layer, number of layers)``.

Threads: ``execute`` and ``save_kv`` run on the engine thread; ``write_kv`` and
``payload_views`` run on the KV loader's threads while ``execute`` runs, into blocks of the
step that no layer reads before ``layer_ready`` lets it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ModelOutput, SchedulerOutput

# layer_ready(layer): called before ``layer`` reads the KV cache; blocks until the step's
# loads for that layer are in place
LayerReady = Callable[[int], None]


@runtime_checkable
class ModelRunner(Protocol):
    """Runs steps of the model over a paged KV pool of ``num_blocks`` blocks."""

    spec: KVSpec  # the pool's layout: block size, layers, KV format
    num_blocks: int
    num_layers: int
    vocab_size: int
    # True: ``execute`` leaves a chunk's first ``kv_in_pool`` rows unwritten (their K/V is in
    # the pool: a prompt cached whole, its last token computed for its logits alone)
    skips_cached_writes: bool
    # True: ``payload_views`` may be used (the pool is host memory); False: the tiers' reads
    # land in host buffers and ``write_kv`` copies them over (a pool on another device)
    reads_in_place: bool

    def execute(
        self, sched_out: SchedulerOutput, layer_ready: LayerReady | None = None
    ) -> ModelOutput:
        """Run one step: write the scheduled tokens' K/V into their slots (but the first
        ``kv_in_pool`` of an item, where ``skips_cached_writes``), attend, and sample
        for the requests that sample. ``layer_ready``, when given, is called before each
        layer reads the cache (the step's planned loads stream in meanwhile). Also drops what
        the runner keeps beside blocks ``sched_out.released_block_ids`` (freed unhashed)."""
        ...

    def save_kv(self, block_ids: list[int]) -> Any:
        """A host copy of these device blocks, every layer, as a payload: a buffer (bytes, a
        numpy array) the caller owns, taken now, before a later step can reuse the blocks."""
        ...

    def write_kv(
        self,
        block_ids: list[int],
        payload: Any,
        num_entry_blocks: int,
        skip: int,
        layers: tuple[int, int],
    ) -> int:
        """Copy one stored layer group (a payload of ``num_entry_blocks`` blocks, ``skip`` of
        them before ``block_ids``) into the device blocks ``block_ids``. Returns the bytes
        copied."""
        ...

    def payload_views(
        self, block_ids: list[int], skip: int, num_entry_blocks: int, layers: tuple[int, int]
    ) -> list[memoryview]:
        """Writable buffers that, filled in order with one stored layer group's payload,
        put its blocks from ``skip`` on straight into the device blocks ``block_ids`` (the
        skipped and trailing blocks go to scratch buffers)."""
        ...
