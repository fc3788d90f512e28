"""``LoRAManager``: the adapters an engine knows, the ``max_loras`` slots they take turns in, and
each step's tokens' slots (``splitserve.engine.lora.layers``).

An adapter is read once (``add``), checked against the model, and kept on the host; a request
naming it takes a slot (``acquire``): the one it already holds, else a free one, else the least
recently used one no running request holds, into which its weights are copied. A request gives
its slot back when it ends (``release``). When every slot holds an adapter of running requests, a
request for another one waits (``can_acquire`` is False: the scheduler leaves it queued) until one
of them ends, as in vLLM; it is never mixed up with another adapter.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Sequence

import torch

from splitserve.engine.lora.adapter import LoRAAdapter, load_adapter
from splitserve.engine.lora.layers import GroupedRows, MaskedRows, TokenSlots, wrap_projections

log = logging.getLogger(__name__)


class AdapterExists(ValueError):
    """An adapter of that name is loaded already."""


class AdapterInUse(ValueError):
    """Running requests hold the adapter."""


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device, grouped: bool = False):
        """``grouped``: the step's tokens sorted by slot for grouped-GEMM launches (the Triton
        kernels); otherwise each token's slot for the C++ kernel (a CPU where the kernels built),
        else the masked stack of all slots."""
        self.max_loras, self.max_rank = max_loras, max_rank
        if grouped:
            self.rows = GroupedRows(max_tokens, max_loras, max_rank, device)
        elif device.type == "cpu" and _cpu_kernel_ready():
            self.rows = TokenSlots(max_tokens, max_loras, max_rank, device)
        else:
            self.rows = MaskedRows(max_tokens, max_loras, max_rank, dtype, device)
        self.layers = wrap_projections(model, self.rows, max_loras, dtype, device)
        self.known: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras  # the adapter in each slot
        self.recent: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self.users: Counter[str] = Counter()  # adapter -> requests holding its slot

    # ---- adapters ------------------------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read, check and register an adapter; ValueError naming what does not fit this model."""
        return self.register(self.read(name, path))

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check an adapter (any thread: it only reads files and the layers' shapes)."""
        if not name:
            raise ValueError("LoRA adapter: a name is required")
        self._check_new(name)
        adapter = load_adapter(name, path, self.max_rank)
        for module, (a, b) in adapter.weights.items():
            layer = self.layers.get(module)
            if layer is None:
                raise ValueError(f"LoRA adapter {name!r}: the model has no projection {module} (is the adapter for "
                                 "this base model?)")
            if (b.shape[0], a.shape[1]) != (layer.out_features, layer.in_features):
                raise ValueError(f"LoRA adapter {name!r}: {module} is {a.shape[1]} -> {b.shape[0]} in the adapter, "
                                 f"{layer.in_features} -> {layer.out_features} in the model (another base model?)")
        return adapter

    def register(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Make a read adapter available to requests (the engine's thread)."""
        self._check_new(adapter.name)
        self.known[adapter.name] = adapter
        log.info("LoRA adapter %s: rank %d, %d projections, from %s", adapter.name, adapter.rank,
                 len(adapter.weights), adapter.path)
        return adapter

    def _check_new(self, name: str) -> None:
        if name in self.known:
            raise AdapterExists(f"LoRA adapter {name!r} is already loaded")

    def remove(self, name: str) -> None:
        if name not in self.known:
            raise KeyError(name)
        if self.users[name]:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {self.users[name]} running request(s)")
        slot = self.recent.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            self._write(slot, None)
        del self.known[name]

    # ---- slots ---------------------------------------------------------------------------
    def can_acquire(self, name: str) -> bool:
        """Whether ``acquire(name)`` would find a slot now (its own, a free one, or one no running
        request holds)."""
        return name in self.recent or None in self.slots or any(not self.users[r] for r in self.recent)

    def acquire(self, name: str) -> int:
        """The slot of ``name`` for one more request (loaded into one if need be)."""
        if name not in self.known:
            raise ValueError(f"LoRA adapter {name!r} is not loaded here")
        slot = self.recent.get(name)
        if slot is None:
            slot = self._free_slot(name)
            self._write(slot, self.known[name])
            self.slots[slot] = name
            self.recent[name] = slot
        self.recent.move_to_end(name)
        self.users[name] += 1
        return slot

    def release(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]

    def _free_slot(self, name: str) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for resident, slot in self.recent.items():  # least recently used first
            if not self.users[resident]:
                del self.recent[resident]
                return slot
        raise ValueError(f"LoRA adapter {name!r}: all {self.max_loras} adapter slots (--max-loras) hold adapters of "
                         "running requests")

    @torch.inference_mode()
    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy ``adapter``'s weights into ``slot`` of every layer (zeros where it has none)."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for module, layer in self.layers.items():
            layer.lora_a[rows].zero_()
            layer.lora_b[rows].zero_()
            if adapter is not None and module in adapter.weights:
                a, b = adapter.weights[module]
                r = a.shape[0]
                layer.lora_a[rows.start:rows.start + r].copy_(a)
                layer.lora_b[rows.start:rows.start + r].copy_(b.t())

    # ---- steps ---------------------------------------------------------------------------
    def prepare_step(self, rows: Sequence, query_start: Sequence[int]) -> None:
        """Tell the layers the slot of each token of a step whose rows (scheduled chunks, in input
        order) start at ``query_start``."""
        slots: list[int | None] = []
        for i, row in enumerate(rows):
            self._check_slot(row)
            slots += [row.request.lora_slot] * (query_start[i + 1] - query_start[i])
        self.rows.write(slots)

    @staticmethod
    def _check_slot(row) -> None:
        if row.request.lora_slot is None and row.request.lora is not None and not row.request.is_finished:
            # It would run as the base model (a finished request is only a static batch's padding).
            raise RuntimeError(f"request {row.request.request_id} runs without its adapter's slot")


def _cpu_kernel_ready() -> bool:
    """Whether the C++ kernel of csrc/lora_cpu.cpp loaded (its shape rule registered for the
    compiled step once)."""
    global _fake_registered
    from splitserve.engine.attention import cpu_kernels
    if not cpu_kernels.available():
        return False
    if not _fake_registered:
        torch.library.register_fake("splitserve_cpu::lora_update")(
            lambda x, lora_a, lora_b, token_slot, rank: x.new_empty((x.shape[0], lora_b.shape[1])))
        _fake_registered = True
    return True


_fake_registered = False
