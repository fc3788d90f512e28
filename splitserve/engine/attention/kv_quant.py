"""Quantized KV pages (``--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2``): the row format.

A quantized pool keeps the pool's usual shape ``[layers, 2, blocks, block_size, kv_heads, row]``
with ``row = head_dim + 4``: each (token, head) row is ``head_dim`` 8-bit codes followed by the
four bytes of its float32 scale (``x ~= code * scale``, ``scale = amax(|x|) / qmax``). The pool's
torch dtype is the code's (``int8``, ``float8_e4m3fn``, ``float8_e5m2``), so a pool tensor says
what it holds without a side channel: ``KVLayout.of_pool`` reads the KV dtype off it, and every
transport, which moves whole pages, ships codes and scales together unchanged.

Why per token and head: a token's row is written once, when its K/V is computed, and never again,
so the decode write is one row and nothing is requantized. A scale per page and head would save
the 4 bytes a row (6% of a 64-wide head) but a token whose amax exceeds its page's scale forces
the whole page to be requantized (and its earlier tokens to lose precision) inside every write
kernel; a per-tensor static scale (vLLM's default) needs calibration and clips outliers.
The cost: pages per GB are ``2 * head_dim / (head_dim + 4)`` times bf16's (1.88x at 64, 1.94x at 128).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.config import KV_CACHE_DTYPES, KV_SCALE_BYTES as SCALE_BYTES
from splitserve.engine.kv_sizes import kv_row_elements
# How scales are laid out, as the handoff's KVLayout names it ("" for unquantized pools).
SCALE_LAYOUT = "f32_per_token_head"


@dataclass(frozen=True)
class KVQuant:
    name: str  # canonical KV dtype name: int8, fp8_e4m3, fp8_e5m2
    storage: torch.dtype  # dtype of the codes, and of the pool tensor
    qmax: float  # largest code magnitude: amax maps onto it
    code: int  # id the C++ kernels dispatch on (csrc/paged_attention_cpu.cpp, KvCode)


_FORMATS = {
    "int8": KVQuant("int8", torch.int8, 127.0, 1),
    "fp8_e4m3": KVQuant("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2),
    "fp8_e5m2": KVQuant("fp8_e5m2", torch.float8_e5m2, 57344.0, 3),
}
_BY_STORAGE = {f.storage: f for f in _FORMATS.values()}


def kv_quant(kv_cache_dtype: str) -> KVQuant | None:
    """The format of a ``--kv-cache-dtype`` value; None for ``auto`` (pages in the model dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    return _FORMATS["fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype]


def of_storage(dtype: torch.dtype) -> KVQuant | None:
    """The format of a pool of this torch dtype; None for an unquantized (float) pool."""
    return _BY_STORAGE.get(dtype)


def row_width(head_dim: int, quant: KVQuant | None) -> int:
    """Elements of one (token, head) row of the pool."""
    return kv_row_elements(head_dim, quant is not None)


def head_dim_of(cache: torch.Tensor) -> int:
    """The attention head size of a cache or pool (its last dim, less a quantized row's scale)."""
    return cache.shape[-1] - (SCALE_BYTES if of_storage(cache.dtype) else 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 when it is fp8, which several CPU ops (index_copy_, equal) lack."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def quantize(x: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] rows of ``quant.storage``: codes, then the float32 scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / quant.qmax
    # An all-zero row keeps scale 0 and codes 0 (dequantizes to zeros) instead of dividing by 0.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = (xf * inv).clamp(-quant.qmax, quant.qmax)
    if quant.storage == torch.int8:
        codes = codes.round()
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    rows[..., :-SCALE_BYTES] = codes.to(quant.storage).view(torch.uint8)
    rows[..., -SCALE_BYTES:] = scale.view(torch.uint8)
    return rows.view(quant.storage)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] quantized rows -> [..., D] of ``dtype``."""
    raw = rows.view(torch.uint8)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    codes = rows[..., :-SCALE_BYTES].float()
    return (codes * scale).to(dtype)


def load(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache as ``dtype`` values, dequantized if the cache is quantized."""
    return dequantize(cache, dtype) if of_storage(cache.dtype) else cache.to(dtype)


def store_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows [..., D] in the form a cache of ``cache_dtype`` stores them."""
    quant = of_storage(cache_dtype)
    return quantize(x, quant) if quant else x.to(cache_dtype)
