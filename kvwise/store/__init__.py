"""Tiered KV storage below the device pool: host RAM, local disk, Redis. Pure Python, no torch.

A tier stores opaque entries (``serde.pack`` output) under 32-byte keys (a block chain hash);
``tiered.TieredStore`` orders the tiers, checks entries, promotes hits and writes in the
background; ``costmodel.CostModel`` says when loading beats recomputing.
"""
