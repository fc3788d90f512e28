"""The KV handoff contract between the engine and whatever moves KV pages (``splitserve.kvtransfer``).

The engine knows nothing of transports, leases or descriptors; kvtransfer knows nothing of the
scheduler's or the runner's insides. They meet here, in two sides, as vLLM's KV connector splits
them:

* **the scheduler side** (``KVHandoffEngine``): what an engine offers the handoff. A decode
  worker *reserves* pages for a prompt whose KV will arrive, *releases* them if it never does,
  and *admits* the request once it has (``add_prefilled_request``). A prefill worker runs a
  prompt as a one-token request whose pages are shipped while it computes. ``LLMEngine``
  implements it; kvtransfer's connectors are typed against it, not against the engine class.
* **the worker side**: what runs inside a step. Rank 0's model runner holds one
  ``KVConnector`` (``LLMEngine.attach_kv_connector``): each step it asks for the step's orders
  for the other tensor-parallel ranks, calls ``save_layer`` as soon as a layer's K/V are in the
  pool (so copies overlap the next layer's compute), and hands back what the other ranks could
  not ship. Every other rank holds a ``FollowerKVConnector`` that carries out those orders on its
  own slice of the heads. The orders and a connector's set-up messages are the connector's own
  types, registered with the ranks' message codec (``tensor_parallel.messages.register``).

A tensor-parallel engine whose ranks need a follower connector is told which program its ranks
run (``EngineConfig``-independent: ``LLMEngine(..., tp_follower=MODULE)``, a module whose
``main()`` calls ``splitserve.engine.tp_follower.run`` with its connector and pool).
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from splitserve.engine.outputs import RequestOutput
    from splitserve.engine.request import Request
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import SchedulerOutput


class KVConnector(abc.ABC):
    """The worker side on rank 0: called by the model runner during each step that has one attached.

    With a connector attached, decode steps are not replayed from CUDA graphs (the per-layer
    call must run), and the step waits for the other ranks' reports when it sent them orders."""

    def step_orders(self, plan: "SchedulerOutput") -> tuple:
        """What every other tensor-parallel rank's ``FollowerKVConnector`` does this step
        (registered message types; ``()``: nothing, and the ranks send no report back)."""
        return ()

    @abc.abstractmethod
    def save_layer(self, plan: "SchedulerOutput", layer: int) -> None:
        """Layer ``layer``'s K/V of this step are in the pool (on a GPU: queued on the compute
        stream). Must not block on the copy itself."""

    def followers_failed(self, failures: dict[str, str]) -> None:
        """What the other ranks could not ship this step: {request id: why}. Called after the
        forward of every step that sent orders (an empty dict when all went well)."""


class FollowerKVConnector(abc.ABC):
    """The worker side on a tensor-parallel rank r > 0 (``splitserve.engine.tp_follower``)."""

    @abc.abstractmethod
    def setup(self, message: Any) -> Any:
        """A set-up message rank 0 sent (``LLMEngine.configure_follower_kv``); the reply goes back."""

    @abc.abstractmethod
    def save_layer(self, orders: tuple, layer: int) -> None:
        """This rank's slice of layer ``layer`` is in its pool: carry out ``orders`` for it."""

    @abc.abstractmethod
    def finish_step(self, orders: tuple) -> dict[str, str]:
        """The step's forward is done: make this step's copies land; {request id: why it failed}."""

    def close(self) -> None:
        """The rank is stopping."""


class KVHandoffEngine(Protocol):
    """The scheduler side: what an engine offers the handoff (``LLMEngine`` implements it).
    Every method runs on the engine's own thread."""

    # The model's name, as both ends of a handoff compare it.
    model_name: str
    # Ranks of this engine: each holds kv_heads / tensor_parallel_size of every page.
    tensor_parallel_size: int
    # The pool as [layers, 2 (K, V), blocks, block_size, kv_heads, row], whatever its page order.
    kv_cache: "torch.Tensor"

    def blocks_needed(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens of KV take."""

    def reserve_pages(self, request_id: str, num_tokens: int,
                      prompt_token_ids: Sequence[int] | None = None) -> tuple[list[int], int] | None:
        """Pages for a prompt of ``num_tokens`` whose KV will be written from elsewhere, or None
        when the pool is short: (page ids in order, how many leading pages are this engine's own
        prefix-cache hits, shared and already holding that KV). ValueError if the id has pages."""

    def release_pages(self, request_id: str) -> bool:
        """Free a reservation that never became a request (or abort the request it became);
        False when there was neither."""

    def set_aside_pages(self, request_id: str, holder: str) -> None:
        """Keep the pages of a reservation that never became a request out of use, under the id
        ``holder`` (freed later with ``release_pages(holder)``): a sender in another process may
        still be copying into them. ``request_id`` may reserve again at once."""

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], params: "SamplingParams",
                              first_token: int, priority: int = 0,
                              first_logprobs: list[tuple[int, float]] | None = None,
                              arrival_time: float | None = None,
                              sampler_state: bytes | None = None) -> "RequestOutput":
        """Decode a request whose prompt KV now sits in its reserved pages."""

    def add_request(self, request_id: str | None, prompt: Sequence[int], params: "SamplingParams | None" = None,
                    priority: int = 0, arrival_time: float | None = None) -> "Request":
        """Queue a prompt (a prefill worker queues it with ``max_tokens=1``)."""

    def abort_request(self, request_id: str) -> "RequestOutput | None":
        ...

    def step(self) -> list["RequestOutput"]:
        ...

    def attach_kv_connector(self, connector: KVConnector | None) -> None:
        """Rank 0's worker side for every later step (None: detach)."""

    def configure_follower_kv(self, message: Any) -> list[Any]:
        """Send a set-up message to every other rank's ``FollowerKVConnector``; their replies in
        rank order (``[]`` without tensor parallelism)."""
