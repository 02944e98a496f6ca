"""One prefill for n copies of a prompt: a waiting request whose prompt another running
request is computing now (the same tokens in the same namespace: n choices of one prompt,
or a burst of one prompt) waits for those blocks to be cached, then hits them, rather than
compute them twice. The scheduler asks before it admits (``Scheduler._admit_waiting``)."""

from __future__ import annotations

from kvwise.core.request import Request
from kvwise.core.request_hashes import RequestHashes


def shared_prefill(
    request: Request, running: list[Request], hashes: RequestHashes
) -> Request | None:
    """A running request prefilling now the blocks of most of ``request``'s prompt, or None.
    Worth waiting for: most of the prompt, and more than what it has cached already."""
    block_size = hashes.block_size
    num_full = (request.num_tokens - 1) // block_size
    if request.sampling_params.prompt_logprobs is not None:
        return None
    hashes.extend(request, num_full * block_size)
    mine = request.block_hashes[:num_full]
    for other in running:
        computed, theirs = other.num_computed_tokens // block_size, other.block_hashes
        if other.num_computed_tokens >= other.num_prompt_tokens or computed >= num_full:
            continue
        shared = 0
        while shared < min(num_full, len(theirs)) and theirs[shared] == mine[shared]:
            shared += 1
        if shared > computed and 2 * shared * block_size >= request.num_prompt_tokens:
            return other
    return None
