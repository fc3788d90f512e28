"""Page arithmetic, in one place: what one token's KV costs, how many pages a memory budget buys,
how many pages a sequence takes. The model runner sizes its pool with it, the KV cache manager
counts pages with it, and ``splitserve.cli.sizing`` answers "how much fits" with the same numbers.
No torch here: the CLI imports it without loading a model.
"""
from __future__ import annotations

from splitserve.engine.config import KV_SCALE_BYTES


def kv_row_elements(head_dim: int, quantized: bool) -> int:
    """Elements of one (token, head) row of the pool: a quantized row (1-byte codes) carries its
    float32 scale as ``KV_SCALE_BYTES`` more bytes."""
    return head_dim + KV_SCALE_BYTES if quantized else head_dim


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: int, quantized: bool = False) -> int:
    """One token's KV on one rank: K and V, every layer, the rank's KV heads."""
    return 2 * layers * kv_heads * kv_row_elements(head_dim, quantized) * element_bytes


def pages_for_budget(budget_gib: float, bytes_per_token: int, block_size: int) -> int:
    """Pages a pool of ``budget_gib`` GiB holds (at least one)."""
    return max(1, int(budget_gib * 2**30) // (bytes_per_token * block_size))


def pages_for_tokens(num_tokens: int, block_size: int) -> int:
    """Pages ``num_tokens`` tokens take (the last one partly filled)."""
    return -(-num_tokens // block_size)
