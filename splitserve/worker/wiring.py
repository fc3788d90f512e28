"""The wiring that builds an engine for a role: the engine, its KV pool where the transports
need it, the other tensor-parallel ranks running kvtransfer's follower side, and the connector
that moves its KV (``splitserve.kvtransfer``).

Offline, ``splitserve.engine.LLM`` builds a plain engine; only workers hand KV over.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

from splitserve.common.locality import remove_pools_of
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_runner import resolve_device
from splitserve.engine.tensor_parallel import FollowerProgram
from splitserve.kvtransfer import TRANSPORTS, DecodePool, choose_transports, open_decode, open_prefill
from splitserve.kvtransfer.tensor_parallel import tp_transports

# What the other ranks of a tensor-parallel worker run: the engine's follower with kvtransfer's
# side of the handoff (splitserve.worker.tp_follower); a rank killed outright leaves its pool behind.
KV_FOLLOWER = FollowerProgram("splitserve.worker.tp_follower", remove_pools_of)


def build_decode(config: EngineConfig, transport: str = "auto", lease_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time, host: str = "127.0.0.1", advertise_host: str | None = None,
                 kv_key: bytes | None = None):
    """A decode engine whose pool accepts KV over ``transport`` (``auto`` or a comma list); returns
    its DecodeConnector (``.engine`` is the engine)."""
    names = choose_transports(transport, resolve_device(config.device).type)
    if config.tensor_parallel_size > 1:
        names = tp_transports(names, transport == "auto", config.tensor_parallel_size)
    pool = DecodePool(names)
    engine = LLMEngine(_one_kv_group(config), pool_factory=pool, tp_follower=KV_FOLLOWER)
    return open_decode(engine, pool, lease_ttl_s, clock, host, advertise_host, kv_key)


def build_prefill(config: EngineConfig, transports: Iterable[str] = TRANSPORTS, verify_checksum: bool = False,
                  kv_key: bytes | None = None):
    """A prefill engine that ships KV over any of ``transports``; returns its PrefillConnector."""
    engine = LLMEngine(_one_kv_group(config), tp_follower=KV_FOLLOWER)
    return open_prefill(engine, transports, verify_checksum, kv_key)


def _one_kv_group(config: EngineConfig) -> EngineConfig:
    """The handoff moves one block table's pages: a windowed model's layers keep every page in one
    group on both sides (as vLLM turns its hybrid KV cache manager off under a KV connector)."""
    return dataclasses.replace(config, disable_hybrid_kv_cache_manager=True)
