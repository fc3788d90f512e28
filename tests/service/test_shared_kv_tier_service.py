"""The host KV tier shared by a host's workers (``--kv-offloading-shared``) in a served stack: two
prefill workers and a decode worker map one tier. A prompt prefilled on one prefill worker, which
then leaves (SIGTERM: it drains and leaves its prefix cache to the tier), is served on the other
from the tier, with transformers' tokens; the tier stays while a worker maps it and goes with the
last."""
import signal
import time

from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.tools import scrape

BLOCK = 8  # the test stacks' --block-size


def loaded_pages(stack, name: str) -> float:
    return scrape(stack.metrics_ports[name]).get("splitserve:kv_offload_pages_total{op=loaded,tier=host}", 0.0)


def test_a_prefix_one_prefill_worker_computed_is_loaded_by_another(tiny_model_dirs, tmp_path, private_shm,
                                                                   llama_reference):
    stack = start_stack(tiny_model_dirs["llama"], tmp_path, prefill=2, decode=1,
                        worker_args=["--num-gpu-blocks", "24", "--kv-offloading-size", "0.002",
                                     "--kv-offloading-shared"])
    try:
        tiers = list(private_shm.glob("splitserve-kvtier-*"))
        assert len(tiers) == 1  # one for the three workers
        baseline = stack.free_pages()
        prompt = [3] + [40 + (3 * 7 + i) % 60 for i in range(80)]
        want = llama_reference.greedy(prompt, 6)

        def run():
            events = list(stack.client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60))
            return [t for e in events for t in e.token_ids], events[-1]
        tokens, final = run()
        assert tokens == want
        first = final.timeline.prefill_worker
        name = next(n for n in stack.names("prefill") if first in stack.argv[n])
        other = next(n for n in stack.names("prefill") if n != name)
        assert stack.kill(name, sig=signal.SIGTERM) == 0  # its cached prefix goes to the tier
        del baseline[name]
        before = loaded_pages(stack, other)
        tokens, final = run()
        assert tokens == want
        assert final.timeline.prefill_worker != first
        # 10 full blocks of 8 of the 81-token prompt (the last token is always computed), from the
        # tier (the counter is exported between steps: wait for it).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and loaded_pages(stack, other) - before < 10:
            time.sleep(0.1)
        assert loaded_pages(stack, other) - before == 10
        assert final.usage.cached_prompt_tokens == 80
        wait_pages_at_baseline(stack, baseline)
    finally:
        stack.close()
    assert not tiers[0].exists()  # the last worker out removed it
