"""Chained block hashes for prefix caching.

A full block's hash is SHA-256 over length-prefixed, domain-separated fields: the parent
block's hash, the block's token ids and any extra keys. The root of every chain is itself a
hash of (model fingerprint, tenant namespace, optional salt), so the same block hash can never
mean two different things: not across models, KV layouts, tenants or salts.

Length prefixes make field boundaries unambiguous: ("ab", "c") and ("a", "bc") hash apart,
which plain string concatenation does not guarantee.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

BlockHash = bytes

_ROOT_DOMAIN = b"kvwise.root.v1"
_BLOCK_DOMAIN = b"kvwise.block.v1"


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def root_hash(
    model_fingerprint: str, tenant: str = "default", salt: str | None = None
) -> BlockHash:
    """The chain's root: every block hash of this (model, tenant, salt) descends from it."""
    h = hashlib.sha256(_field(_ROOT_DOMAIN))
    h.update(_field(model_fingerprint.encode()))
    h.update(_field(tenant.encode()))
    h.update(_field(b"" if salt is None else b"\x01" + salt.encode()))
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash (the root for the first block)."""
    h = hashlib.sha256(_field(_BLOCK_DOMAIN))
    h.update(_field(parent))
    h.update(_field(struct.pack(f"<{len(token_ids)}q", *token_ids)))
    h.update(_field(extra))
    return h.digest()


def hash_block_chain(
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    parent: BlockHash | None = None,
) -> Iterable[BlockHash]:
    """Yield the hashes of the full blocks of ``token_ids`` from block index ``start``.

    ``parent`` is the hash of block ``start - 1`` (``root`` when ``start == 0``).
    """
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent: required when start > 0")
    num_full_blocks = len(token_ids) // block_size
    for i in range(start, num_full_blocks):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        yield prev
