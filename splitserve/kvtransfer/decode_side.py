"""Decode side of the handoff: reserve pages, describe them, admit the request once its KV is in.

The engine side is the scheduler half of ``splitserve.engine.kv_connector.KVHandoffEngine``
(reserve, release, admit). Runs on the decode worker's engine thread (the engine is not
thread-safe); only the
transport's receiver threads run elsewhere, and they touch pool memory alone, under the
lease fence.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

from splitserve.engine.kv_connector import KVHandoffEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvtransfer.base import ChecksumMismatchError, KVLayout, TransferDescriptor, kv_checksum
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.transports.base import KVReceiver

log = logging.getLogger(__name__)


class DecodeConnector:
    def __init__(self, engine: KVHandoffEngine, receivers: Sequence[KVReceiver], leases: LeaseTable,
                 rank_offers: tuple = (), cleanup: Sequence[Callable[[], None]] = ()):
        if not receivers:
            raise ValueError("a decode connector needs at least one transport")
        self.engine = engine
        # Fastest first: every descriptor offers all of them, in this order.
        self.receivers = list(receivers)
        self.leases = leases
        self.layout = KVLayout.of_pool(engine.model_name, engine.kv_cache, engine.tensor_parallel_size)
        # Pages each reservation took from this side's prefix cache (never sent): request id -> count.
        self._cached_pages: dict[str, int] = {}
        # Tensor parallelism: the other ranks' receivers (splitserve.kvtransfer.tensor_parallel), in every descriptor.
        self.rank_offers = rank_offers
        self._cleanup = list(cleanup)
        self.num_expired = 0
        # Pages of ended leases that a sender in another process was still copying into:
        # holder id (the engine holds them under it) -> page ids. Freed once no copy is under way.
        self.set_aside: dict[str, tuple[int, ...]] = {}

    def reserve(self, request_id: str, num_prompt_tokens: int,
                prompt_token_ids: Sequence[int] | None = None) -> TransferDescriptor | None:
        """Pages for a prompt of ``num_prompt_tokens`` tokens, or None when the pool is short.

        Given the prompt itself, its head is served from this worker's prefix cache: those pages
        are shared (a ref each, like an engine's own prefix hit) and the descriptor's
        ``num_cached_blocks`` tells the prefill side not to send them. That is how the samples of
        an ``n > 1`` request, and prompts with a common system prefix, hold one copy of their
        shared KV here and cross the wire once."""
        reserved = self.engine.reserve_pages(request_id, num_prompt_tokens, prompt_token_ids)
        if reserved is None:
            return None
        table, cached = reserved
        self._cached_pages[request_id] = cached
        # Only the pages to be written are leased (fenced): a transport may never touch a shared one.
        lease = self.leases.grant(request_id, table[cached:])
        first, *rest = self.receivers
        return TransferDescriptor(request_id, first.name, first.address, tuple(table), self.layout,
                                  lease.epoch, lease.deadline, tuple((r.name, r.address) for r in rest),
                                  num_cached_blocks=cached, rank_offers=self.rank_offers)

    def renew(self, request_id: str, epoch: int) -> float:
        """The handoff of ``request_id`` is still under way: its lease restarts. Returns the
        seconds it now lives; raises (stale epoch, expired) when it is gone. Thread-safe: the
        lease table is, and no engine state is touched."""
        self.leases.renew(request_id, epoch)
        return self.leases.ttl_s

    def complete(self, request_id: str, epoch: int, prompt_token_ids: Sequence[int], params: SamplingParams,
                 first_token: int, checksum: int | None = None, priority: int = 0,
                 first_logprobs: list[tuple[int, float]] | None = None, arrival_time: float | None = None,
                 sampler_state: bytes | None = None) -> RequestOutput:
        """The prefill side flushed every layer: check the epoch (and checksum), then start decoding.

        A stale epoch or an expired lease raises and leaves the pages to their current owner;
        a checksum mismatch frees the pages and raises.
        """
        lease = self.leases.complete(request_id, epoch)
        # From here the pages belong to the engine's request: no transport may write them.
        self.leases.release(request_id)
        cached = self._cached_pages.pop(request_id, 0)
        if checksum is not None:
            # Over the pages that came (the cached head was never sent): the leased ones.
            skipped = cached * self.layout.block_size
            got = kv_checksum(self.engine.kv_cache, lease.block_ids, len(prompt_token_ids) - skipped)
            if got != checksum:
                self.engine.release_pages(request_id)
                raise ChecksumMismatchError(f"request {request_id!r}: KV checksum {got:#010x} != "
                                            f"{checksum:#010x} sent by the prefill side; pages freed")
        return self.engine.add_prefilled_request(request_id, prompt_token_ids, params, first_token,
                                                 priority=priority, first_logprobs=first_logprobs,
                                                 arrival_time=arrival_time, sampler_state=sampler_state)

    def abort(self, request_id: str) -> bool:
        """Drop a reservation (mid-transfer) or a running request. True if there was one.

        A reservation's pages are fenced at once (no new copy starts); if a sender is still
        copying into them they are set aside, not freed, until it has stopped (``sweep``):
        another request given them now would have its KV overwritten by the late copy."""
        lease = self.leases.release(request_id)
        self._cached_pages.pop(request_id, None)
        if lease is not None and not lease.completed and not self.leases.fence.quiet(lease.block_ids):
            holder = f"{request_id}#set-aside-{lease.epoch}"
            self.engine.set_aside_pages(request_id, holder)
            self.set_aside[holder] = lease.block_ids
            log.warning("%s ended while a sender was still copying into %d of its pages; they are set aside "
                        "until the copy stops", request_id, len(lease.block_ids))
            return True
        return self.engine.release_pages(request_id) or lease is not None

    def sweep(self) -> int:
        """Free the set-aside pages no sender is copying into any more; returns how many."""
        freed = 0
        for holder, block_ids in list(self.set_aside.items()):
            if self.leases.fence.quiet(block_ids):
                self.engine.release_pages(holder)
                del self.set_aside[holder]
                freed += len(block_ids)
        return freed

    def reap_expired(self) -> list[str]:
        """Free the pages of handoffs whose prefill side went quiet past the lease (and the
        set-aside pages whose copies have stopped)."""
        expired = self.leases.expired()
        for request_id in expired:
            log.warning("lease of %s expired before its KV arrived; pages freed", request_id)
            self.abort(request_id)
        self.num_expired += len(expired)
        self.sweep()
        return expired

    @property
    def transports(self) -> list[str]:
        return [r.name for r in self.receivers]

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()
        self.leases.fence.close()
        for cleanup in self._cleanup:
            cleanup()
