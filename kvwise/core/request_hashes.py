"""What a request's blocks are called: each KV group's hash chain of a request, extended as its
tokens fill blocks, in its namespace (model, tenant, salt; a declared public prefix under the
public root: ``hashing.BlockHasher``, which routers share). The chains are kept on the request
(``Request.block_hashes``, ``Request.group_hashes``); the block manager, the tier plans and the
scheduler's shared-prefill check all read them through here.

A whole-prompt hit's kept last row (``ScheduledRequest.last_row_key``) is named by the hash of
the prompt's last block: ``last_row_key``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwise.core.hashing import BlockHash, BlockHasher, group_hash
from kvwise.core.request import Request


class RequestHashes:
    """The hash chains of requests' full blocks over one ``BlockHasher``."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size

    def extend(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover the full blocks of its first
        ``num_tokens`` tokens."""
        if request.num_public_blocks is None:
            prompt = request.token_ids[: request.num_prompt_tokens]
            request.num_public_blocks = self.hasher.num_public_blocks(prompt)
        self.hasher.extend(
            request.block_hashes,
            request.token_ids,
            num_tokens,
            request.tenant,
            request.cache_salt,
            request.num_public_blocks,
        )

    def of_group(self, request: Request, group: int) -> list[BlockHash]:
        """The chain hashes of group ``group``'s blocks of a request, as far as its
        ``block_hashes`` go (group 0: those; the others: ``hashing.group_hash`` of them)."""
        if group == 0:
            return request.block_hashes
        while len(request.group_hashes) < group:
            request.group_hashes.append([])
        hashes = request.group_hashes[group - 1]
        for h in request.block_hashes[len(hashes) :]:
            hashes.append(group_hash(h, group))
        return hashes

    @staticmethod
    def every_group(block_hashes: Sequence[BlockHash], num_groups: int) -> list[BlockHash]:
        """Group 0's hashes, then each other group's copy of them."""
        return [group_hash(h, g) if g else h for g in range(num_groups) for h in block_hashes]

    def last_row_key(self, request: Request, end: int) -> BlockHash:
        """The name of the last row of a block-aligned prompt ending at ``end`` (its last
        block's hash)."""
        self.extend(request, end)
        return request.block_hashes[end // self.block_size - 1]
