"""What a prefix hit covers, for tests' expectations."""


def whole_hit(num_tokens: int, block_size: int = 16) -> int:
    """Cached tokens of a prompt whose every full block the pool holds: all its full blocks,
    but never its last token, which is computed for its logits (a block-aligned prompt's
    last token reads its K/V from the pool: every token but that one)."""
    if num_tokens % block_size == 0:
        return num_tokens - 1
    return (num_tokens - 1) // block_size * block_size
