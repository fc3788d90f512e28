"""A step's flat model inputs, built from the scheduler's plan with vectorised numpy.

The Python work per step is one pass over the scheduled sequences (their token slices and
block tables are copied by C-level slice assignment); positions, slot mapping and the sample
indices are whole-array numpy expressions, whatever the number of tokens. Everything lands in
buffers allocated once for the engine's limits, so a step allocates nothing and, on CUDA,
every step's inputs live at the same addresses (as CUDA graphs need) and reach the device
in one non-blocking copy each from pinned memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from splitserve.engine.attention import StepLayout
from splitserve.engine.scheduler import ScheduledChunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64, on the device
    layout: StepLayout
    # The layout of each further KV group (kv_groups): the same step over that group's block
    # tables and slots; empty with one group.
    group_layouts: tuple[StepLayout, ...]
    # Rows of the hidden states whose logits are sampled, and the chunks they sample for: one row
    # per chunk, or 1 + its proposals for a speculative decode (its last 1 + P rows, in order).
    sample_index: torch.Tensor  # [S] int64, on the device
    sample_chunks: list[ScheduledChunk]


@dataclass
class VerifyRow:
    """One position of a speculative decode, fed as a decode of its own: a chunk [newest token,
    d_1..d_P] becomes P + 1 one-token rows over the same block table, row i at position start + i
    attending to everything up to it. Each layer writes the step's K/V before it attends, so row
    i sees d_1..d_i; and decode attention reads the pages where they lie, where a multi-token
    chunk after cached context would gather that context once per layer (measured on the CPU
    backend: the gathers and SDPA of such chunks cost more than the whole decode kernel)."""
    request: object
    start: int
    token_id: int
    num_tokens: int = 1
    samples: bool = True
    padding: bool = False
    spec_token_ids: list = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return True


def expand_verification(chunks: list[ScheduledChunk]) -> list:
    """``chunks`` with every speculative decode replaced by its VerifyRows (in place, so the
    sampled rows keep the chunks' order)."""
    if not any(c.spec_token_ids for c in chunks):
        return chunks
    rows: list = []
    for c in chunks:
        if c.spec_token_ids:
            fed = [c.request.all_token_ids[c.start], *c.spec_token_ids]
            rows.extend(VerifyRow(c.request, c.start + i, t) for i, t in enumerate(fed))
        else:
            rows.append(c)
    return rows


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, num_groups: int = 1, pad_tokens: Callable[[int], int] | None = None):
        """``max_seqs``: rows of one step (sequences; with speculative decoding each verified
        position is a row of its own). ``num_groups``: KV groups, each with block tables and
        slots of its own (``kv_groups``). ``pad_tokens``: the token count a step of n tokens is
        fed as (``cpu_linear.padded_rows`` where the linears would pad each input to it
        themselves); the tokens past n are padding (see ``build``)."""
        self.block_size = block_size
        self.device = device
        self.pad_tokens = pad_tokens
        if pad_tokens is not None:
            max_tokens = pad_tokens(max_tokens)
        pin = device.type == "cuda"

        def host(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        # Host side (numpy views share the memory of the torch tensors).
        self._ids = host(max_tokens, dtype=torch.int64)
        self._pos = host(max_tokens, dtype=torch.int64)
        self._slots = host(max_tokens, dtype=torch.int64)
        self._qsl = host(max_seqs + 1, dtype=torch.int32)
        self._lens = host(max_seqs, dtype=torch.int32)
        self._tables = host(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self._sample = host(max_seqs, dtype=torch.int64)
        self._host = [self._ids, self._pos, self._slots, self._qsl, self._lens, self._tables, self._sample]
        # Device side: the same tensors on CPU, copies of them elsewhere.
        self._dev = self._host if device.type == "cpu" else [t.to(device) for t in self._host]
        # Marks the end of the last host-to-device copies: the host buffers are rewritten only after
        # them (a step that samples nothing never waits on the device, so the next one could
        # otherwise overwrite pinned memory a queued non-blocking copy has yet to read).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # Groups 1..: (slots, tables) on the host and on the device.
        self._group_host = [(host(max_tokens, dtype=torch.int64), host(max_seqs, max_blocks_per_seq, dtype=torch.int32))
                            for _ in range(num_groups - 1)]
        self._group_dev = self._group_host if device.type == "cpu" else \
            [tuple(t.to(device) for t in pair) for pair in self._group_host]

    @property
    def device_tensors(self) -> list[torch.Tensor]:
        """ids, positions, slots, query starts, seq lens, block tables, sample rows: full-size device buffers."""
        return self._dev

    def fill_padding(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` as padding decodes (CUDA graphs replay padded batches): token 0 at
        position 0, no KV write (slot -1), no context to read; on the host, copied to the device."""
        self._ids[lo:hi] = 0
        self._pos[lo:hi] = 0
        self._slots[lo:hi] = -1
        self._lens[lo:hi] = 0
        self._qsl[lo + 1:hi + 1] = torch.arange(lo + 1, hi + 1, dtype=torch.int32)
        if self.device.type != "cpu":
            for host, dev in zip(self._host[:5], self._dev[:5]):
                dev[lo:hi + 1].copy_(host[lo:hi + 1], non_blocking=True)

    def build(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
              pad_to: int | None = None, group_block_tables: dict[str, list[list[int]]] | None = None) -> StepInputs:
        """Inputs of one step; ``chunks`` are ordered decodes (and speculative decodes) first.
        ``group_block_tables``: the further KV groups' tables per request (``SchedulerOutput``).

        ``pad_to``: a pure-decode batch replayed by a CUDA graph of that many rows; the rows past
        the batch are written as padding too.

        With ``pad_tokens``, a step of n tokens is fed as ``pad_tokens(n)``: the tokens past n are
        token 0 at position 0 with no KV write (slot -1), in no sequence (the query starts end at
        n), so attention neither reads nor writes for them and no row is sampled from them. Each
        row of the other ops depends on its own row only, so what those rows hold stays in them.
        On the CPU each oneDNN linear would otherwise copy its input into a padded buffer (4 a
        layer: ~3 ms of a 78 ms 250-token bf16 prefill on 2 AMX cores)."""
        if self._copied is not None:
            self._copied.synchronize()
        sample_chunks = [c for c in chunks if c.samples]
        chunks = expand_verification(chunks)
        bs = self.block_size
        num_seqs = len(chunks)
        q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num_seqs)
        qsl = self._qsl.numpy()[:num_seqs + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts + q_lens

        ids = self._ids.numpy()
        tables = self._tables.numpy()
        width = 1
        for i, chunk in enumerate(chunks):
            tokens = chunk.request.all_token_ids
            lo = qsl[i]
            if chunk.padding:  # static batching: keep the row busy with its last token
                ids[lo] = tokens[-1]
            elif isinstance(chunk, VerifyRow):
                ids[lo] = chunk.token_id
            elif chunk.in_flight_row is not None:
                ids[lo] = 0  # the step in flight samples it; the runner copies it in on the device
            elif chunk.num_tokens == 1:
                ids[lo] = tokens[chunk.start]
            else:
                ids[lo:qsl[i + 1]] = tokens[chunk.start:chunk.start + chunk.num_tokens]
            table = block_tables[chunk.request.request_id]
            tables[i, :len(table)] = table
            width = max(width, len(table))

        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = self._pos.numpy()[:num_tokens]
        np.add(np.repeat(starts - qsl[:-1], q_lens), np.arange(num_tokens), out=positions)
        page_of_token, offset = positions // bs, positions % bs
        self._slots.numpy()[:num_tokens] = tables[seq_of_token, page_of_token].astype(np.int64) * bs + offset
        group_widths = []
        for g, (slots_g, tables_g) in enumerate(self._group_host):
            tables_np, width_g = tables_g.numpy(), 1
            for i, chunk in enumerate(chunks):
                table = group_block_tables[chunk.request.request_id][g]
                tables_np[i, :len(table)] = table
                width_g = max(width_g, len(table))
            slots_g.numpy()[:num_tokens] = tables_np[seq_of_token, page_of_token].astype(np.int64) * bs + offset
            group_widths.append(width_g)
        self._lens.numpy()[:num_seqs] = seq_lens
        sample_at = qsl[1:][np.fromiter((c.samples for c in chunks), dtype=bool, count=num_seqs)] - 1
        num_rows = len(sample_at)
        self._sample.numpy()[:num_rows] = sample_at

        if pad_to is not None:
            self.fill_padding(num_seqs, pad_to)
        fed = num_tokens
        if self.pad_tokens is not None and pad_to is None:
            fed = self.pad_tokens(num_tokens)
            ids[num_tokens:fed] = 0
            self._pos.numpy()[num_tokens:fed] = 0
            self._slots.numpy()[num_tokens:fed] = -1
            for slots_g, _ in self._group_host:
                slots_g.numpy()[num_tokens:fed] = -1
        ids_d, pos_d, slots_d, qsl_d, lens_d, tables_d, sample_d = self._to_device(fed, num_seqs, num_rows)
        layout = StepLayout(
            slot_mapping=slots_d[:fed],
            query_start_loc=qsl_d[:num_seqs + 1],
            seq_lens=lens_d[:num_seqs],
            block_tables=tables_d[:num_seqs, :width],
            num_decodes=sum(1 for c in chunks if c.is_decode),
            query_lens_list=q_lens.tolist(),
            seq_lens_list=seq_lens.tolist(),
            query_start_list=qsl.tolist(),
            block_size=bs,
        )
        group_layouts = tuple(dataclasses.replace(layout, slot_mapping=slots_g[:fed],
                                                  block_tables=tables_g[:num_seqs, :width_g])
                              for (slots_g, tables_g), width_g in zip(self._group_dev, group_widths))
        return StepInputs(ids_d[:fed], pos_d[:fed], layout, group_layouts, sample_d[:num_rows], sample_chunks)

    def _to_device(self, num_tokens: int, num_seqs: int, num_rows: int) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return self._dev
        used = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs, num_rows]
        for host, dev, n in zip(self._host, self._dev, used):
            dev[:n].copy_(host[:n], non_blocking=True)
        for (slots_h, tables_h), (slots_d, tables_d) in zip(self._group_host, self._group_dev):
            slots_d[:num_tokens].copy_(slots_h[:num_tokens], non_blocking=True)
            tables_d[:num_seqs].copy_(tables_h[:num_seqs], non_blocking=True)
        self._copied.record()
        return self._dev
