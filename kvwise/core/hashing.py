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
from dataclasses import dataclass, field

BlockHash = bytes

_ROOT_DOMAIN = b"kvwise.root.v1"
_BLOCK_DOMAIN = b"kvwise.block.v1"
_JUNCTION_DOMAIN = b"kvwise.junction.v1"
_GROUP_DOMAIN = b"kvwise.group.v1"
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


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The hash of the same block in hybrid KV group ``group`` >= 1 (group 0 uses the chain's
    own hashes): each group's copy of a block is its own entry in the pool and the tiers."""
    h = hashlib.sha256(_field(_GROUP_DOMAIN))
    h.update(_field(block_hash))
    h.update(struct.pack("<Q", group))
    return h.digest()


def junction_hash(public_parent: BlockHash, tenant_root: BlockHash) -> BlockHash:
    """The parent of the first tenant block after a public prefix."""
    h = hashlib.sha256(_field(_JUNCTION_DOMAIN))
    h.update(_field(public_parent))
    h.update(_field(tenant_root))
    return h.digest()


@dataclass
class BlockHasher:
    """The hash chain of a sequence's full blocks, as the engine's prefix cache computes it:
    from the (model, tenant, salt) root, or — for the part of a prompt that matches a declared
    public prefix, in whole chunks of ``public_min_tokens`` — from the public root, then on
    through the junction. The engine's ``KVCacheManager`` and a router outside it share this
    one implementation, so a router's chain for a prompt is the engine's."""

    model_fingerprint: str
    block_size: int
    public_prefixes: list[list[int]] = field(default_factory=list)
    public_min_tokens: int = 256
    _roots: dict[tuple[str, str | None], BlockHash] = field(default_factory=dict, repr=False)

    def root(self, tenant: str, salt: str | None = None) -> BlockHash:
        key = (tenant, salt)
        if key not in self._roots:
            self._roots[key] = root_hash(self.model_fingerprint, tenant, salt)
        return self._roots[key]

    def num_public_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading blocks of ``token_ids`` shared as a public prefix (whole chunks only)."""
        best = 0
        for prefix in self.public_prefixes:
            n = 0
            limit = min(len(prefix), len(token_ids))
            while n < limit and prefix[n] == token_ids[n]:
                n += 1
            best = max(best, n)
        shared_tokens = best // self.public_min_tokens * self.public_min_tokens
        return shared_tokens // self.block_size

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        num_tokens: int,
        tenant: str,
        salt: str | None,
        num_public: int,
    ) -> None:
        """Append to ``hashes`` (the chain so far) the hashes of the full blocks among the
        first ``num_tokens`` of ``token_ids``; ``num_public``: ``num_public_blocks`` of the
        prompt."""
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            if i == 0:
                parent = self.root(PUBLIC_TENANT, None) if num_public else self.root(tenant, salt)
            elif i == num_public:
                parent = junction_hash(hashes[-1], self.root(tenant, salt))
            else:
                parent = hashes[-1]
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))

    def chain(
        self, token_ids: Sequence[int], tenant: str = "default", salt: str | None = None
    ) -> list[BlockHash]:
        """The hashes of every full block of a prompt ``token_ids``."""
        hashes: list[BlockHash] = []
        num_public = self.num_public_blocks(token_ids)
        self.extend(hashes, token_ids, len(token_ids), tenant, salt, num_public)
        return hashes
