"""The cluster's prefix directory in a served stack (two prefill workers, one decode worker, each
prefill step slowed so that a request's prefill is still running while the next one is placed):
each worker publishes what it caches, and a prompt that continues one goes to the worker holding
it from this gateway and from a second one, is served from its cache and gives transformers'
tokens; a worker that leaves takes its entries with it.

The workers share one host KV tier (``--kv-offloading-shared``): the prefill worker that leaves
(SIGTERM: it drains and stores its prefix cache there) has its prompt served by the other one from
the tier, with transformers' tokens; the tier stays while a worker maps it and goes with the last."""
import signal
import threading

import pytest

from splitserve.client import Client
from splitserve.engine.block_pool import prefix_block_hashes
from splitserve.state import prefixes
from splitserve.state.store import RedisState
from tests.harness.stack import start_process, start_stack, stop_process, wait_pages_at_baseline
from tests.harness.streams import wait_until
from tests.harness.tools import scrape

BLOCK = 8  # the test stacks' --block-size
STEP_DELAY_S = 1.0  # every prefill step's: a placement while one runs sees it in flight


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    """The workers' shared-memory directory (their shared tier's file), this module's own."""
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory, shm_dir):
    shm = {"SPLITSERVE_SHM_DIR": str(shm_dir)}
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=2, decode=1,
                          worker_args=["--num-gpu-blocks", "64", "--kv-offloading-size", "0.002",
                                       "--kv-offloading-shared"],
                          role_env={"prefill": {"SPLITSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S), **shm},
                                    "decode": shm})
    try:
        yield running
    finally:
        running.close()
    assert not list(shm_dir.glob("splitserve-kvtier-*"))  # the last worker out removed the tier


def prompt_of(first: int, n: int = 81) -> list[int]:
    return [first] + [40 + (first * 11 + i) % 60 for i in range(n - 1)]


def generate(client, prompt, request_id=""):
    events = list(client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=120,
                                  request_id=request_id))
    return [t for e in events for t in e.token_ids], events[-1]


def holders(state: RedisState, workers: list[str], prompt: list[int]) -> set[str]:
    """The workers whose directory entries hold every full block of ``prompt``'s first 80 tokens."""
    hashes = prefix_block_hashes(prompt[:80], BLOCK)
    return {w for w, tiers in zip(workers, prefixes.lookup(state, workers, hashes)) if None not in tiers}


def test_prompts_go_where_their_prefix_is_cached_from_every_gateway(stack, llama_reference):
    baseline = stack.free_pages()
    state = RedisState(stack.redis.client())
    workers = [w["worker_id"] for w in state.workers() if w["role"] == "prefill"]
    assert len(workers) == 2
    a, b = prompt_of(3), prompt_of(4)
    results = {}
    thread = threading.Thread(target=lambda: results.update(a=generate(stack.client, a, "first-a")), daemon=True)
    thread.start()
    wait_until(lambda: (state.get("first-a") or {}).get("state") == "prefilling", 60, "a's prefill")
    # While a's prefill runs (a second at least), b goes to the other prefill worker: by load.
    tokens_b, final_b = generate(stack.client, b)
    thread.join(60)
    tokens_a, final_a = results["a"]
    assert tokens_a == llama_reference.greedy(a, 4) and tokens_b == llama_reference.greedy(b, 4)
    worker_a, worker_b = final_a.timeline.prefill_worker, final_b.timeline.prefill_worker
    assert {worker_a, worker_b} == set(workers)
    wait_until(lambda: holders(state, workers, a) == {worker_a} and holders(state, workers, b) == {worker_b}, 10,
               "each prompt in the directory under its worker")

    # Continuations: each goes to its prompt's worker and is served from its cache (80 tokens,
    # 10 full blocks; decode worker's own cache aside), from this gateway and from a second one.
    other, address = start_process([*stack.argv["gateway"], "--gateway-id", "gw-second"],
                                   stack.log_dir / "gateway-second.log")
    client = Client(address)
    try:
        for n, (gateway, prompt, worker) in enumerate([(stack.client, a, worker_a), (stack.client, b, worker_b),
                                                       (client, b, worker_b), (client, a, worker_a)]):
            more = prompt + [50 + n, 51, 52 + n]
            tokens, final = generate(gateway, more)
            assert tokens == llama_reference.greedy(more, 4)
            assert final.timeline.prefill_worker == worker
            assert final.usage.cached_prompt_tokens >= 80
    finally:
        client.close()
        stop_process(other, stack.log_dir / "gateway-second.log")
    wait_pages_at_baseline(stack, baseline)


def loaded_pages(stack, name: str) -> float:
    return scrape(stack.metrics_ports[name]).get("splitserve:kv_offload_pages_total{op=loaded,tier=host}", 0.0)


def test_a_worker_that_leaves_takes_its_entries_and_leaves_its_cache_to_the_host(stack, shm_dir, llama_reference):
    assert len(list(shm_dir.glob("splitserve-kvtier-*"))) == 1  # one tier for the three workers
    state = RedisState(stack.redis.client())
    prompt = prompt_of(9)
    tokens, final = generate(stack.client, prompt)
    worker_id = final.timeline.prefill_worker
    wait_until(lambda: state.client.hlen(state.prefixes_key(worker_id)) >= 10, 10, "its entries")
    name = next(n for n in stack.names("prefill") if stack.argv[n][stack.argv[n].index("--worker-id") + 1] == worker_id)
    other = next(n for n in stack.names("prefill") if n != name)
    assert stack.kill(name, sig=signal.SIGTERM) == 0  # drains, stores its prefix cache, leaves the registry
    assert not state.client.exists(state.prefixes_key(worker_id))
    before = loaded_pages(stack, other)
    again, final = generate(stack.client, prompt)
    assert again == tokens == llama_reference.greedy(prompt, 4)
    assert final.timeline.prefill_worker != worker_id and final.usage.cached_prompt_tokens == 80
    # Its 10 full blocks of 8 (the last token is always computed) from the tier; the counter is
    # exported between steps.
    wait_until(lambda: loaded_pages(stack, other) - before >= 10, 10, "the loads to be counted")
    assert loaded_pages(stack, other) - before == 10
