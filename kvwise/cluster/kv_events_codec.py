"""KV event batches (``core/kv_events.py``) as msgpack, in the shape vLLM publishes them.

vLLM encodes with msgspec structs that are ``array_like`` and tagged by class name: a batch is
``[ts, [event, ...]]`` (a third item, the data-parallel rank, when there is one) and an event
is ``[tag, *fields]``::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

kvwise's ``token_ids`` is always empty (a router learns hashes, never text) and ``lora_id``
None; hashes are kvwise's 32-byte SHA-256 block hashes (vLLM's may be ints or bytes).
``msgpack`` comes with the ``ray`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwise.core.kv_events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def _msgpack():
    try:
        import msgpack
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("KV event batches need msgpack: pip install 'kvwise[ray]'") from exc
    return msgpack


def encode_batch(events: Sequence[KVEvent], ts: float, rank: int | None = None) -> bytes:
    items = []
    for e in events:
        if isinstance(e, BlockStored):
            items.append(
                [
                    "BlockStored",
                    list(e.block_hashes),
                    e.parent_block_hash,
                    [],
                    e.block_size,
                    None,
                    e.medium,
                ]
            )
        elif isinstance(e, BlockRemoved):
            items.append(["BlockRemoved", list(e.block_hashes), e.medium])
        elif isinstance(e, AllBlocksCleared):
            items.append(["AllBlocksCleared"])
        else:
            raise ValueError(f"events: not a KV event: {e!r}")
    batch = [ts, items] if rank is None else [ts, items, rank]
    return _msgpack().packb(batch, use_bin_type=True)


def decode_batch(data: bytes) -> tuple[float, list[KVEvent]]:
    """``encode_batch``'s inverse; also reads vLLM's batches (their token ids are ignored)."""
    try:
        batch = _msgpack().unpackb(data, raw=False)
        ts, items = batch[0], batch[1]
        events: list[KVEvent] = []
        for item in items:
            tag = item[0]
            if tag == "BlockStored":
                medium = item[6] if len(item) > 6 and item[6] else DEVICE
                events.append(BlockStored(list(item[1]), item[2], int(item[4]), medium))
            elif tag == "BlockRemoved":
                medium = item[2] if len(item) > 2 and item[2] else DEVICE
                events.append(BlockRemoved(list(item[1]), medium))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown event tag {tag!r}")
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"kv_events: not a KV event batch ({exc})") from None
    return float(ts), events
