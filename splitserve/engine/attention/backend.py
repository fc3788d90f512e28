"""What every attention backend gets per step, and the interface it implements."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """The flattened batch of one step, built once by the model runner and shared by all layers.

    Sequences are ordered decodes first: tokens ``0 .. num_decodes-1`` are one decode each.
    """

    # Cache slot (block * block_size + offset) each new token's K/V is written to. [T] int64
    slot_mapping: torch.Tensor
    # Sequence b's new tokens are rows query_start_loc[b]:query_start_loc[b+1]. [B+1] int32
    query_start_loc: torch.Tensor
    # Context length of each sequence including its new tokens. [B] int32
    seq_lens: torch.Tensor
    # Physical block ids per sequence; entries past a sequence's pages are never read. [B, W] int32
    block_tables: torch.Tensor
    num_decodes: int
    # The same facts as Python lists, so backends plan without device syncs.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    query_start_list: list[int] | None = None

    def __post_init__(self) -> None:
        if self.query_start_list is None:
            starts = [0]
            for n in self.query_lens_list:
                starts.append(starts[-1] + n)
            self.query_start_list = starts


@dataclass(frozen=True)
class AttentionVariant:
    """What one layer's attention does beyond causal softmax attention over every earlier token.

    ``transformers`` hands these to the attention function of each layer (``sliding_window``,
    ``softcap``, ``s_aux``), so layers of one model may differ (Gemma 3 and gpt-oss alternate
    windowed and full layers). Every backend implements all three, with the semantics of
    ``reference.paged_attention``.
    """

    # A token at position p attends to positions p - window + 1 .. p (itself and the window - 1
    # before it), as transformers' sliding-window mask; 0: every earlier position.
    window: int = 0
    # Scores (after the scale) become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0: none.
    softcap: float = 0.0
    # One learned logit per query head that joins each softmax's denominator and weighs no value
    # ("attention sinks", gpt-oss); [num_q_heads] float32, contiguous (the op converts a model's), or None.
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return not self.window and not self.softcap and self.sinks is None


PLAIN = AttentionVariant()


class AttentionBackend(abc.ABC):
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context."""

    name: str

    @abc.abstractmethod
    def prepare(self, layout: StepLayout) -> object:
        """Per-step precomputation shared by every layer (index tensors, masks)."""

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout, prepared: object,
                scale: float, variant: AttentionVariant = PLAIN) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D]; caches [blocks, block_size, Hkv, D]. -> [T, Hq, D]"""
