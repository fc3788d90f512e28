"""``up --role-controller`` moves a worker under a running load (splitserve/cli/role_controller.py): a
prefill worker becomes a decode worker while requests stream, and nothing is lost (every request
ends with transformers' tokens), nothing leaks (every pool's pages come back, the old process's
shared-memory pool is gone) and the registry shows the new roles.

The targets are set so that the move is certain: every TPOT is "late", no TTFT is, and with
``--disaggregation auto --min-prefill-workers 0`` the two decode workers then prefill themselves."""
import random
import threading
import time

from splitserve.state.connect import make_client
from splitserve.state.store import RedisState
from tests.harness.stack import live_request_keys, worker_info
from tests.harness.streams import wait_until
from tests.harness.up import start_up


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(rng.randint(6, 40))]


def test_a_prefill_worker_becomes_a_decode_worker_under_load(tiny_model_dirs, tmp_path_factory, llama_reference):
    log_dir = tmp_path_factory.mktemp("role-change")
    args = ["--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--block-size", "8",
            "--num-gpu-blocks", "128", "--prefill", "1", "--decode", "1", "--num-threads", "1",
            "--disaggregation", "auto", "--local-prefill-tokens", "0", "--role-controller",
            "--min-prefill-workers", "0", "--role-tpot-target-ms", "0.001", "--role-ttft-target-ms", "100000",
            "--role-check-interval-s", "0.5", "--role-change-interval-s", "0", "--drain-timeout-s", "10"]
    with start_up(args, log_dir) as up:
        up.wait_log("role controller on")
        results, errors, stop = [], [], threading.Event()

        def load(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                p = prompt(rng)
                try:
                    events = list(up.client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=60))
                    results.append((p, [t for e in events for t in e.token_ids], events[-1].timeline.prefill_worker))
                except Exception as e:  # noqa: BLE001 - any failure is the test's finding
                    errors.append(e)
        threads = [threading.Thread(target=load, args=(seed,), daemon=True) for seed in range(3)]
        for t in threads:
            t.start()
        moved = up.wait_log("becomes a decode worker", timeout_s=120)
        assert "prefill0 becomes a decode worker: TPOT p90" in moved
        up.wait_log("role controller: decode1 serves", timeout_s=120)
        # Load goes on over the new fleet for a while, then stops.
        served_before = len(results)
        wait_until(lambda: len(results) >= served_before + 6, 60, "requests after the move")
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        # transformers' tokens (hundreds of requests in ever-changing batches: a near-tie may go
        # the other way, HFReference.agrees)
        bad = [(p, tokens) for p, tokens, _ in results if not llama_reference.agrees(p, tokens)]
        assert not bad, (len(results), bad[:3])
        # Some went through the prefill worker before the move, the later ones were prefilled locally.
        assert any(worker for *_, worker in results) and not any(worker for *_, worker in results[-5:])

        state = RedisState(make_client(up.redis_url, password=_password(up)))
        workers = state.workers()
        assert sorted(w["role"] for w in workers) == ["decode", "decode"]
        # Every page back on both decode workers (free counts cached pages nobody holds).
        for w in workers:
            wait_until(lambda w=w: (lambda i: i.kv_blocks_free == i.kv_blocks_total and not i.num_running)(
                worker_info(w["address"])), 30, f"{w['worker_id']}'s pages")
        # No request left in Redis, and up's log says nothing was restarted (the move is no crash).
        wait_until(lambda: not live_request_keys(state.client), 30, "request records to end")
        assert "exited with code" not in up.log()


def _password(up) -> str:
    import os

    import psutil
    config = os.path.join(psutil.Process(up.pids["redis"]).cwd(), "redis.conf")
    return next(line.split()[1] for line in open(config) if line.startswith("requirepass "))
