"""Chained block hashes for prefix caching.

A full block's hash is SHA-256 over length-prefixed, domain-separated fields: the parent
block's hash, the block's token ids and any extra keys. The root of every chain is itself a
hash of (model fingerprint, tenant namespace, optional salt), so the same block hash can never
mean two different things: not across models, KV layouts, tenants or salts.

Public prefixes (declared by the operator, e.g. a shared system prompt) hash under a public
root instead; the first block after the public part descends from a junction hash that mixes
in the tenant's root, so everything past the public part is the tenant's own again.

Length prefixes make field boundaries unambiguous: ("ab", "c") and ("a", "bc") hash apart,
which plain string concatenation does not guarantee.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT_DOMAIN = b"kvwise.root.v1"
_BLOCK_DOMAIN = b"kvwise.block.v1"
_JUNCTION_DOMAIN = b"kvwise.junction.v1"
PUBLIC_TENANT = "\x00public"  # cannot collide with a tenant name (those are printable)


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


def junction_hash(public_parent: BlockHash, tenant_root: BlockHash) -> BlockHash:
    """The parent of the first tenant block after a public prefix."""
    h = hashlib.sha256(_field(_JUNCTION_DOMAIN))
    h.update(_field(public_parent))
    h.update(_field(tenant_root))
    return h.digest()
