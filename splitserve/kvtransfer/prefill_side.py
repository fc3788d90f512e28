"""Prefill side of the handoff: run the prompt, ship its KV layer by layer, report the first token.

The connector is the engine's ``KVConnector`` (``splitserve.engine.kv_connector``): the model
runner calls ``save_layer`` once a layer's K/V of the step are in the prefill pool; the connector queues that layer's page runs for a copy thread, so copies of layer l overlap
the compute of layer l+1. At the end of the step the queue is drained (the pages of finished
requests may be reused by the next step), each finished transfer is flushed, and the result
carries what the decode side needs to ``complete``.

On a GPU "in the pool" means "queued on the compute stream": the hook records an event there,
and the copy thread issues the layer's copies on its own CUDA stream after waiting for that
event on the device (not on the host), so copies run beside the next layer's kernels. At the end
of the step the compute stream waits for the copy stream before any page can be rewritten; the
senders themselves make sure their bytes landed before ``flush`` returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from splitserve.engine.kv_connector import KVConnector, KVHandoffEngine
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.kvtransfer.base import (KVLayout, LayoutMismatchError, TransferDescriptor, TransferError,
                                       TransportUnavailableError, coalesce, kv_checksum)
from splitserve.kvtransfer.head_map import RESHARD_TRANSPORTS, HeadSlice, check_pair, rank_descriptor, routes
from splitserve.kvtransfer.transports.base import KVSender

log = logging.getLogger(__name__)

SenderFactory = Callable[[str], KVSender]  # address -> sender over this side's pool
# Senders kept open at most (one per decode address in use); past it the least recently used goes.
MAX_SENDERS = 64


@dataclass
class PrefillResult:
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    # Set on success.
    first_token: int | None = None
    first_logprobs: list[tuple[int, float]] | None = None
    checksum: int | None = None
    # The seeded generator's state after the first token (None without a seed): the decode
    # side continues the same random stream.
    sampler_state: bytes | None = None
    # Prompt tokens whose KV came from this side's prefix cache.
    num_cached_tokens: int = 0
    # Set on failure: the transfer error; the request's prefill pages are already freed.
    error: TransferError | None = None
    num_copies: int = 0
    bytes_sent: int = 0
    # The transport that carried the pages.
    transport: str | None = None
    # Seconds spent copying and flushing this request's pages (overlapping the prefill compute).
    transfer_s: float = 0.0
    # Wall clock (time.time_ns, as trace spans use) of the first page write and of the flush's
    # end: the transfer's span in a trace (0: unknown, e.g. a transfer refused mid-prefill).
    transfer_start_ns: int = 0
    transfer_end_ns: int = 0


@dataclass
class _Transfer:
    desc: TransferDescriptor
    # Where this rank's pages go: (sender, the decode rank's descriptor, the heads or None for
    # whole pages); one entry unless the decode worker is split otherwise (head_map.routes).
    targets: list[tuple[KVSender, TransferDescriptor, HeadSlice | None]]
    prompt_token_ids: list[int]
    request: Request
    # The heads of this pool that decode rank 0 holds, which its checksum covers (None: all of
    # them); no checksum when decode rank 0 holds heads of other prefill ranks too.
    checksum_heads: HeadSlice | None = None
    checksummed: bool = True
    first_chunk: bool = True
    checksum: int | None = None
    error: TransferError | None = field(default=None)
    transfer_s: float = 0.0
    first_write_ns: int = 0
    # This transfer's own page runs and bytes, counted around each of its writes: a sender is
    # shared by every transfer to its decode worker, and the transfers of one step take turns on
    # it (read from the sender's totals, two samples prefilled in one step each counted both).
    num_copies: int = 0
    bytes_sent: int = 0

    @property
    def sender(self) -> KVSender:
        """The sender to decode rank 0 (or to the first decode rank this rank writes): its transport is the transfer's."""
        return self.targets[0][0]


class PrefillConnector(KVConnector):
    def __init__(self, engine: KVHandoffEngine, senders: dict[str, SenderFactory], verify_checksum: bool = False):
        self.engine = engine
        self.layout = KVLayout.of_pool(engine.model_name, engine.kv_cache, engine.tensor_parallel_size)
        self.sender_factories = senders
        self.verify_checksum = verify_checksum
        # (transport, address) -> its sender, least recently used first.
        self._senders: OrderedDict[tuple[str, str], KVSender] = OrderedDict()
        # Senders out of the cache (broken, their decode pool gone, or pushed out) that a transfer
        # may still be using: closed once none is.
        self._retired: list[KVSender] = []
        self._transfers: dict[str, _Transfer] = {}
        self._copies: queue.Queue = queue.Queue()
        pool = engine.kv_cache
        self._copy_stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        self._copier = threading.Thread(target=self._copy_loop, name="kv-copier", daemon=True)
        self._copier.start()
        engine.attach_kv_connector(self)

    # ---- control -------------------------------------------------------------------
    def start(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
              desc: TransferDescriptor, priority: int = 0, arrival_time: float | None = None) -> None:
        """Check the layout, then queue the prompt for prefill into ``desc``'s pages.

        Only the first token is sampled here, under the request's own rules: with
        ``min_tokens`` >= 1 it cannot be EOS or a stop token, as on a colocated engine.
        ``arrival_time`` (this engine's clock) keeps the request's place in the priority order.
        """
        reshard = check_pair(self.layout, desc.layout)
        blocks_needed = self.engine.blocks_needed(len(prompt_token_ids))
        if len(desc.block_ids) < blocks_needed:
            raise TransferError(f"request {request_id!r}: {len(desc.block_ids)} reserved pages for a prompt "
                                f"needing {blocks_needed}")
        targets = self._targets(desc, reshard)
        transfer = _Transfer(desc, targets, list(prompt_token_ids), None)
        if reshard:
            # Decode rank 0 checks a checksum of its own heads; this rank's first route goes to it
            # from head 0. Computable only when it holds no heads of another prefill rank.
            heads = targets[0][2]
            transfer.checksum_heads = heads
            transfer.checksummed = heads.count == desc.layout.num_kv_heads
        one_token = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        transfer.request = self.engine.add_request(request_id, list(prompt_token_ids), one_token, priority=priority,
                                                   arrival_time=arrival_time)
        self._transfers[request_id] = transfer

    def _targets(self, desc: TransferDescriptor, reshard: bool) -> list[tuple[KVSender, TransferDescriptor,
                                                                            HeadSlice | None]]:
        """Rank 0's destinations: decode rank 0's pages whole, or, re-sharding, the slices of
        every decode rank whose heads meet this rank's (over shm, cuda_ipc or tcp; refused otherwise)."""
        if not reshard:
            return [(self._sender(desc), desc, None)]
        ours, theirs = self.layout, desc.layout
        usable = tuple((t, a) for t, a in desc.offers if t in RESHARD_TRANSPORTS)
        if not usable:
            raise LayoutMismatchError(
                f"request {desc.request_id!r}: this prefill worker has {ours.tensor_parallel_size} tensor-parallel "
                f"rank(s) and the decode worker {theirs.tensor_parallel_size}: KV is re-sharded by head over "
                f"{', '.join(RESHARD_TRANSPORTS)} only, and the decode worker offers "
                f"{', '.join(t for t, _ in desc.offers)}; no bytes moved")
        first = self._sender(dataclasses.replace(desc, transport=usable[0][0], address=usable[0][1],
                                                 alternatives=usable[1:]))
        out = []
        for route in routes(theirs.total_kv_heads, ours.tensor_parallel_size, 0, theirs.tensor_parallel_size):
            rank_desc = rank_descriptor(desc, route.dst_rank, first.name)
            out.append((self._sender(rank_desc), rank_desc, route.heads))
        return out

    def abort(self, request_id: str) -> bool:
        """Stop a request's prefill and transfer; True if it was here."""
        had_transfer = self._transfers.pop(request_id, None) is not None
        return self.engine.abort_request(request_id) is not None or had_transfer

    def step(self) -> list[PrefillResult]:
        """One engine step; returns the transfers that ended (flushed or failed)."""
        outputs = self.engine.step()
        self._copies.join()  # every queued layer copy is issued before pages can be reused...
        if self._copy_stream is not None:  # ...and, on a GPU, the next step's kernels run after them
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)
        results = []
        for out in outputs:
            transfer = self._transfers.pop(out.request_id, None)
            if transfer is None:
                continue
            result = PrefillResult(out.request_id, transfer.desc.epoch, transfer.prompt_token_ids)
            try:
                if transfer.error is not None:
                    raise transfer.error
                flush_start = time.perf_counter()
                for sender, desc, _ in transfer.targets:
                    sender.flush(desc)
                transfer.transfer_s += time.perf_counter() - flush_start
                result.first_token = out.token_ids[0]
                result.first_logprobs = out.logprobs[0] if out.logprobs else None
                result.checksum = transfer.checksum
                result.sampler_state = transfer.request.sampler_state()
                result.num_cached_tokens = out.num_cached_tokens
            except TransferError as e:
                result.error = e
            result.num_copies = transfer.num_copies
            result.bytes_sent = transfer.bytes_sent
            result.transport = transfer.sender.name
            result.transfer_s = transfer.transfer_s
            result.transfer_start_ns, result.transfer_end_ns = transfer.first_write_ns, time.time_ns()
            results.append(result)
        # Transfers refused mid-prefill stop computing at once.
        for request_id, transfer in list(self._transfers.items()):
            if transfer.error is not None:
                self.abort(request_id)
                results.append(PrefillResult(request_id, transfer.desc.epoch, transfer.prompt_token_ids,
                                             error=transfer.error))
        if any(r.error is not None for r in results):  # a broken sender is not kept for the next request
            self._retire_unusable()
        if self._retired:
            self._close_retired()
        return results

    def has_pending(self) -> bool:
        return bool(self._transfers)

    def close(self) -> None:
        for sender in [*self._senders.values(), *self._retired]:
            sender.close()
        self.engine.attach_kv_connector(None)

    # ---- the sender cache: a broken or unreachable sender is rebuilt, not kept --------
    def _retire(self, key: tuple[str, str]) -> None:
        sender = self._senders.pop(key, None)
        if sender is not None:
            self._retired.append(sender)

    def _retire_unusable(self) -> None:
        for key, sender in list(self._senders.items()):
            if not sender.usable():
                log.info("KV sender %s %s retired: %s", *key, "broken" if key[0] == "tcp" else "its pool is gone")
                self._retire(key)

    def _prune(self) -> None:
        """Retire the senders that cannot be used any more, and the oldest past MAX_SENDERS."""
        self._retire_unusable()
        while len(self._senders) >= MAX_SENDERS:
            self._retire(next(iter(self._senders)))

    def _close_retired(self) -> None:
        in_use = {id(sender) for transfer in self._transfers.values() for sender, _, _ in transfer.targets}
        for sender in [s for s in self._retired if id(s) not in in_use]:
            sender.close()  # (a mapped decode pool is unmapped once its last reference goes)
            self._retired.remove(sender)

    # ---- data path -----------------------------------------------------------------
    def _sender(self, desc: TransferDescriptor) -> KVSender:
        """The first offered transport this side supports and can reach; a fallback is logged loudly."""
        refused = []
        for transport, address in desc.offers:
            if transport not in self.sender_factories:
                refused.append(f"{transport}: not enabled here")
                continue
            key = (transport, address)
            if key in self._senders and not self._senders[key].usable():
                self._retire(key)
            if key not in self._senders:
                self._prune()
                try:
                    self._senders[key] = self.sender_factories[transport](address)
                except TransportUnavailableError as e:
                    refused.append(f"{transport}: {e}")
                    continue
            if refused:
                log.warning("KV transfer of %s falls back to %s (%s)", desc.request_id, transport, "; ".join(refused))
            self._senders.move_to_end(key)
            return self._senders[key]
        raise TransportUnavailableError(f"request {desc.request_id!r}: no offered KV transport is usable here ("
                                        + "; ".join(refused) + ")")

    # ---- the engine's KVConnector: called by the model runner during a step -------------
    def save_layer(self, plan: SchedulerOutput, layer: int) -> None:
        last_layer = layer == self.layout.num_layers - 1
        ready = None
        if self._copy_stream is not None:  # this layer's K/V writes are queued, maybe not done
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._copy_stream.device))
        for chunk, transfer, runs in self._shipments(plan):
            self._copies.put((transfer, layer, runs, ready))
            if last_layer:
                transfer.first_chunk = False
                if chunk.samples and self.verify_checksum and transfer.checksummed:
                    self._copies.join()
                    skipped = transfer.desc.num_cached_blocks
                    pool, heads = self.engine.kv_cache, transfer.checksum_heads
                    if heads is not None:  # re-sharded: the heads decode rank 0 holds
                        pool = pool.narrow(4, heads.src_start, heads.count)
                    transfer.checksum = kv_checksum(pool, plan.block_tables[chunk.request.request_id][skipped:],
                                                    len(transfer.prompt_token_ids) - skipped * self.layout.block_size)

    def _shipments(self, plan: SchedulerOutput) -> list[tuple]:
        """(chunk, transfer, page runs) of every transfer this step writes pages of; the same
        for every layer of the step."""
        shipments = []
        bs = self.layout.block_size
        for chunk in plan.chunks:
            transfer = self._transfers.get(chunk.request.request_id)
            if transfer is None or transfer.error is not None:
                continue
            # The first chunk also ships prefix-cache hits: pages this step did not write; the
            # decode side's own cached head is never sent.
            first = max(0 if transfer.first_chunk else chunk.start // bs, transfer.desc.num_cached_blocks)
            last = (chunk.start + chunk.num_tokens - 1) // bs
            if first > last:
                continue  # all of this chunk's pages are already there
            src = plan.block_tables[chunk.request.request_id][first:last + 1]
            shipments.append((chunk, transfer, tuple(coalesce(src, transfer.desc.block_ids[first:last + 1]))))
        return shipments

    def step_orders(self, plan: SchedulerOutput) -> tuple:
        """What the other tensor-parallel ranks ship this step: the same pages, over the transport
        rank 0 picked, each into its own decode rank (splitserve.kvtransfer.tensor_parallel)."""
        from splitserve.kvtransfer.tensor_parallel import CopyOrder
        return tuple(CopyOrder(transfer.desc, transfer.sender.name, runs) for _, transfer, runs in self._shipments(plan))

    def followers_failed(self, failures: dict[str, str]) -> None:
        """A transfer another rank could not ship fails (its pages are incomplete)."""
        for request_id, reason in failures.items():
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.error is None:
                log.warning("KV transfer of %s refused: %s", request_id, reason)
                transfer.error = TransferError(reason)

    @contextlib.contextmanager
    def _after(self, ready):
        """Issue CUDA work on the copy stream, once the compute stream passed ``ready``."""
        if self._copy_stream is None:
            yield
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            yield

    def _copy_loop(self) -> None:
        if self._copy_stream is not None:  # kernels this thread launches go to the pool's GPU
            torch.cuda.set_device(self._copy_stream.device)
        while True:
            transfer, layer, runs, ready = self._copies.get()
            try:
                if transfer.error is None:
                    start = time.perf_counter()
                    transfer.first_write_ns = transfer.first_write_ns or time.time_ns()
                    with self._after(ready):
                        for sender, desc, heads in transfer.targets:
                            copies, sent = sender.num_copies, sender.bytes_sent  # only this thread writes
                            try:
                                if heads is None:
                                    sender.write(desc, layer, runs)
                                else:
                                    sender.write(desc, layer, runs, heads)
                            finally:
                                transfer.num_copies += sender.num_copies - copies
                                transfer.bytes_sent += sender.bytes_sent - sent
                    transfer.transfer_s += time.perf_counter() - start
            except TransferError as e:
                # A fenced page (stale epoch, expired lease) says this worker fell behind: loud.
                log.warning("KV transfer of %s refused: %s", transfer.desc.request_id, e)
                transfer.error = e
            except Exception as e:  # a broken peer must fail this transfer, not the copier
                log.exception("KV copy failed")
                transfer.error = TransferError(f"KV copy failed: {e}")
            finally:
                self._copies.task_done()
