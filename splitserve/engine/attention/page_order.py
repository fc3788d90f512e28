"""How a KV page lies in memory, and the one view every reader of the pool indexes.

A pool is ``[layers, 2 (K, V), blocks, ...]`` with one page per (layer, K or V, block), each page
contiguous, so pages move as whole blocks of bytes (kvtransfer, swapping). Inside a page:

* ``token_major``: ``[block_size, kv_heads, row]``: a token's heads side by side (the Triton
  GPU kernels' layout);
* ``head_major``: ``[kv_heads, block_size, row]``: a head's tokens side by side, so a decode
  walking one KV head reads contiguous rows (the CPU kernel's layout).

``token_view`` gives ``[layers, 2, blocks, block_size, kv_heads, row]`` over either (a strided
view, no copy): attention kernels take strides, so the rest of the engine never asks which.
"""
from __future__ import annotations

import torch

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"
PAGE_ORDERS = (TOKEN_MAJOR, HEAD_MAJOR)


def page_order_for(device_type: str, block_size: int, kv_heads: int) -> str:
    """Head-major on the CPU, token-major on GPUs. With one KV head (or one token per page) the
    two are the same bytes; such a pool is token-major, as ``order_of`` reads it back."""
    return HEAD_MAJOR if device_type == "cpu" and kv_heads > 1 and block_size > 1 else TOKEN_MAJOR


def page_shape(order: str, layers: int, blocks: int, block_size: int, kv_heads: int, row: int) -> tuple[int, ...]:
    """The pool's shape as it lies in memory."""
    if order == TOKEN_MAJOR:
        return layers, 2, blocks, block_size, kv_heads, row
    if order == HEAD_MAJOR:
        return layers, 2, blocks, kv_heads, block_size, row
    raise ValueError(f"page order must be one of {PAGE_ORDERS}, got {order!r}")


def token_view(pages: torch.Tensor, order: str) -> torch.Tensor:
    """``pages`` (shaped by ``page_shape``) as [layers, 2, blocks, block_size, kv_heads, row]."""
    if order not in PAGE_ORDERS:
        raise ValueError(f"page order must be one of {PAGE_ORDERS}, got {order!r}")
    return pages.transpose(3, 4) if order == HEAD_MAJOR else pages


def order_of(pool: torch.Tensor) -> str:
    """The page order of a [layers, 2, blocks, block_size, kv_heads, row] view, read off its
    strides. With one KV head (or one token per page) both orders are the same bytes: token_major."""
    if pool.dim() == 6 and not pool.is_contiguous() and pool.transpose(3, 4).is_contiguous():
        return HEAD_MAJOR
    return TOKEN_MAJOR


def pages_of(pool: torch.Tensor) -> torch.Tensor:
    """A [layers, 2, blocks, block_size, kv_heads, row] view as it lies in memory (``page_shape``
    of its ``order_of``), so that ``pages[layer, kv, block]`` is one contiguous page."""
    return pool.transpose(3, 4) if order_of(pool) == HEAD_MAJOR else pool
