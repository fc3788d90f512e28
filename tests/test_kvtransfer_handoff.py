"""Prefill engine -> KV pages -> decode engine, in one process, over shm and tcp.

Checks the pages arrive byte for byte, that greedy output after the handoff equals
transformers, and that every failure path ends with the pages free on both sides.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from pathlib import Path

import pytest
import torch

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.kvtransfer import LayoutMismatchError, LeaseExpiredError, StaleEpochError
from splitserve.worker.wiring import build_decode, build_prefill
from splitserve.kvtransfer.base import ChecksumMismatchError, kv_checksum
from tests.test_engine_correctness import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class FakeClock:
    def __init__(self):
        self.now = time.time()

    def __call__(self):
        return self.now


def config(model, **kw):
    kw.setdefault("num_gpu_blocks", 128)
    kw.setdefault("enforce_eager", True)
    return EngineConfig(model=str(model), dtype="float32", **kw)


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


@pytest.fixture
def pair(tiny_model_dirs, transport):
    made = []

    def make(block_size=8, prefill_kw=None, decode_kw=None, model=None, **decode_args):
        model = model or tiny_model_dirs["llama"]
        decode = build_decode(config(model, block_size=block_size, **(decode_kw or {})), transport, **decode_args)
        prefill = build_prefill(config(model, block_size=block_size, **(prefill_kw or {})), verify_checksum=True)
        made.append((prefill, decode))
        return prefill, decode

    yield make
    for prefill, decode in made:
        prefill.engine.assert_idle()
        decode.engine.assert_idle()
        assert len(decode.leases) == 0
        prefill.close()
        decode.close()


def fragment(decode):
    """Hold every other page of the decode pool so reservations get non-contiguous pages."""
    kv = decode.engine.kv
    n = kv.num_free_blocks
    for i in range(n):
        kv.allocate(f"frag{i}", kv.block_size)
    for i in range(0, n, 2):
        kv.free(f"frag{i}")
    return [f"frag{i}" for i in range(1, n, 2)]


def handoff(prefill, decode, prompts, params=GREEDY, max_steps=500, tag="r", share_prefix=False):
    """Reserve, prefill with layer-by-layer transfer, complete, decode to the end.
    ``share_prefix``: reserve with the prompt, so the decode side's prefix cache serves its head."""
    descs = {}
    for i, prompt in enumerate(prompts):
        desc = decode.reserve(f"{tag}{i}", len(prompt), prompt if share_prefix else None)
        assert desc is not None
        descs[desc.request_id] = desc
        prefill.start(desc.request_id, prompt, params, desc)
    finished = {}
    for _ in range(max_steps):
        for result in prefill.step():
            assert result.error is None, result.error
            i = int(result.request_id[len(tag):])
            out = decode.complete(result.request_id, result.epoch, prompts[i], params, result.first_token,
                                  checksum=result.checksum)
            if out.finished:
                finished[out.request_id] = out
        for out in decode.engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == len(prompts):
            return [finished[f"{tag}{i}"] for i in range(len(prompts))], descs
    raise AssertionError("handoff did not finish")


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("fragmented", [False, True])
def test_greedy_output_after_shm_handoff_equals_transformers(pair, block_size, fragmented, tiny_model_dirs,
                                                            hf_reference, step_mode):
    # A small step budget chunks the prefill: pages are shipped across several steps. Compiled,
    # the layer hook that ships them runs inside the graph's attention op.
    prefill, decode = pair(block_size, prefill_kw={"max_num_batched_tokens": 24, **step_mode}, decode_kw=step_mode)
    held = fragment(decode) if fragmented else []
    prompts = mixed_prompts(5, seed=block_size, lo=3, hi=45)
    outputs, descs = handoff(prefill, decode, prompts)
    ref = hf_reference(tiny_model_dirs["llama"])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, 8)
    contiguous = all(list(d.block_ids) == list(range(d.block_ids[0], d.block_ids[0] + len(d.block_ids)))
                     for d in descs.values())
    assert contiguous != fragmented or len(descs) == 0
    for rid in held:
        decode.engine.kv.free(rid)


def test_a_prefix_the_decode_side_has_cached_is_not_sent_again(pair, tiny_model_dirs, hf_reference):
    """Reserving with the prompt shares the decode side's cached head (the other samples of an
    n > 1 request, a common system prompt): those pages are neither sent nor leased, the
    checksum covers what came, and the output still equals transformers."""
    prefill, decode = pair(8)
    prefix = mixed_prompts(1, seed=3, lo=40, hi=40)[0]
    [first], _ = handoff(prefill, decode, [prefix + [5]], tag="a")
    # Then the same prompt again (as an n > 1 sibling comes) and one with another suffix.
    prompts = [prefix + [5], prefix + [9, 10, 11]]
    sent_before = sum(s.bytes_sent for s in prefill._senders.values())
    outputs, descs = handoff(prefill, decode, prompts, tag="c", share_prefix=True)
    sent = sum(s.bytes_sent for s in prefill._senders.values()) - sent_before
    ref = hf_reference(tiny_model_dirs["llama"])
    assert first.token_ids == ref.greedy(prefix + [5], 8)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, 8)
    layout = decode.layout
    for desc in descs.values():
        assert desc.num_cached_blocks == 5  # 40 tokens = 5 full pages of 8; the last page always goes
    # Per request: its last page per layer, K and V, instead of 6 pages.
    assert sent == 2 * 2 * layout.num_layers * layout.page_bytes


@pytest.mark.parametrize("transport", ["shm"])
def test_pages_reserved_while_a_decode_forward_runs_leave_every_output_exact(pair, tiny_model_dirs, hf_reference):
    """A decode worker reserves pages beside a step's forward (its engine lets go of its state
    lock there, splitserve/worker/engine_loop.py): prompts reserved so, some sharing cached
    blocks with the requests the forward is computing, and those requests all decode exactly."""
    prefill, decode = pair(8)
    lock = decode.engine.state_lock = threading.Lock()
    head = mixed_prompts(1, seed=7, lo=24, hi=24)[0]  # three full pages, cached once the first request has run
    prompts = [head + tail for tail in mixed_prompts(6, seed=8, lo=2, hi=20)]
    later = list(range(2, len(prompts)))  # reserved inside a forward, one per forward
    descs, during_forward = {}, []
    forward = decode.engine.runner.run

    def run_with_a_reservation_beside(plan):
        if later:
            i = later.pop(0)

            def reserve():
                with lock:  # free only while this forward runs: a join that times out says it was not
                    descs[i] = decode.reserve(f"r{i}", len(prompts[i]), prompts[i])
            side = threading.Thread(target=reserve)
            side.start()
            try:
                return forward(plan)  # computes while the other thread reserves
            finally:
                side.join(10)
                during_forward.append(not side.is_alive())
        return forward(plan)
    decode.engine.runner.run = run_with_a_reservation_beside

    for i in (0, 1):
        descs[i] = decode.reserve(f"r{i}", len(prompts[i]), prompts[i])
    for i in (0, 1):
        prefill.start(f"r{i}", prompts[i], GREEDY, descs[i])
    started, finished = {0, 1}, {}
    with lock:  # held by the stepping thread, as an engine loop's
        for _ in range(500):
            for i in set(descs) - started:
                prefill.start(f"r{i}", prompts[i], GREEDY, descs[i])
                started.add(i)
            for result in prefill.step():
                assert result.error is None, result.error
                i = int(result.request_id[1:])
                decode.complete(result.request_id, result.epoch, prompts[i], GREEDY, result.first_token,
                                checksum=result.checksum)
            for out in decode.engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if len(finished) == len(prompts):
                break
    assert during_forward == [True] * (len(prompts) - 2)
    assert any(d.num_cached_blocks > 0 for i, d in descs.items() if i >= 2)  # shared with a running request
    ref = hf_reference(tiny_model_dirs["llama"])
    for i, prompt in enumerate(prompts):
        assert finished[f"r{i}"].token_ids == ref.greedy(prompt, 8)


def test_a_reservation_leases_only_the_pages_it_writes(pair):
    prefill, decode = pair(8)
    prompt = mixed_prompts(1, seed=4, lo=33, hi=33)[0]
    handoff(prefill, decode, [prompt], tag="a")
    desc = decode.reserve("b", len(prompt), prompt)
    assert desc.num_cached_blocks == 4
    assert decode.leases.get("b").block_ids == desc.block_ids[4:]
    # The shared head is the first request's cached pages, one more reference each.
    kv = decode.engine.kv
    assert all(kv.pool.blocks[b].ref_count == 1 for b in desc.block_ids[:4])
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        decode.reserve("c", len(prompt) + 1, prompt)
    decode.abort("b")


def test_handed_over_requests_past_max_num_seqs_wait_for_a_slot(pair, tiny_model_dirs, hf_reference):
    """More handoffs than the decode batch holds: the extra ones keep their pages and wait (a
    decode worker used to fail its step with 65 rows for 64 slots)."""
    prefill, decode = pair(decode_kw={"max_num_seqs": 2})
    prompts = mixed_prompts(5, seed=7, lo=3, hi=30)
    outputs, _ = handoff(prefill, decode, prompts)
    ref = hf_reference(tiny_model_dirs["llama"])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, 8)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_decode_pages_equal_prefill_pages_byte_for_byte(pair, tmp_path, num_layers, transport):
    from tests.harness.tiny_models import make_tiny_model
    model = make_tiny_model(tmp_path / f"l{num_layers}", num_layers=num_layers)
    prefill, decode = pair(16, model=model)
    held = fragment(decode)
    prompt = mixed_prompts(1, seed=7, lo=70, hi=70)[0]
    desc = decode.reserve("x", len(prompt))
    prefill.start("x", prompt, GREEDY, desc)
    src_table = []
    save_layer = prefill.save_layer  # the connector's per-layer call (splitserve.engine.kv_connector)

    def spy(plan, layer):
        if plan.block_tables.get("x"):
            src_table[:] = plan.block_tables["x"]
        save_layer(plan, layer)
    prefill.save_layer = spy
    [result] = prefill.step()
    src = prefill.engine.runner.kv_cache
    dst = decode.engine.runner.kv_cache
    full, tail = divmod(len(prompt), 16)
    for i, (s, d) in enumerate(zip(src_table, desc.block_ids)):
        n = 16 if i < full else tail
        assert torch.equal(src[:, :, s, :n], dst[:, :, d, :n]), f"page {i}"
    assert result.checksum == kv_checksum(dst, desc.block_ids, len(prompt))
    # 70 tokens = 5 pages into fragmented destination pages: several runs per layer, which tcp
    # sends run by run and shm's page-copy kernel takes in one call per layer.
    if transport == "shm":
        assert result.num_copies == num_layers
    else:
        assert result.num_copies > num_layers
    decode.abort("x")
    for rid in held:
        decode.engine.kv.free(rid)


def test_each_result_counts_its_own_pages_when_transfers_share_a_step(pair):
    """Two prompts prefilled in one step write to one decode worker through one sender: each
    result reports its own pages (the worker's metrics and traces add these up), not the
    sender's total over the step, which counted the other's too (an n > 1 request's two
    samples, prefilled together, showed 10 pages sent where 8 were)."""
    prefill, decode = pair(8)
    prompts = mixed_prompts(2, seed=3, lo=40, hi=40)  # 5 pages of 8 each
    for i, prompt in enumerate(prompts):
        desc = decode.reserve(f"s{i}", len(prompt))
        prefill.start(desc.request_id, prompt, GREEDY, desc)
    sent_before = sum(s.bytes_sent for s in prefill._senders.values())
    copies_before = sum(s.num_copies for s in prefill._senders.values())
    results = prefill.step()
    sent = sum(s.bytes_sent for s in prefill._senders.values()) - sent_before
    copies = sum(s.num_copies for s in prefill._senders.values()) - copies_before
    assert sorted(r.request_id for r in results) == ["s0", "s1"]  # one step prefilled both
    layout = decode.layout
    for result in results:
        assert result.error is None
        assert result.bytes_sent == 5 * 2 * layout.num_layers * layout.page_bytes  # 5 pages a layer, K and V
        assert result.num_copies >= layout.num_layers
    assert sum(r.bytes_sent for r in results) == sent and sum(r.num_copies for r in results) == copies
    for result in results:
        decode.abort(result.request_id)


def test_contiguous_pages_move_as_one_copy_per_layer(pair):
    # (tcp: one frame per run per layer while a run is under the 4 MiB frame limit)
    prefill, decode = pair(8)
    prompt = mixed_prompts(1, seed=3, lo=40, hi=40)[0]
    desc = decode.reserve("c", len(prompt))
    prefill.start("c", prompt, GREEDY, desc)
    [result] = prefill.step()
    assert result.error is None
    assert result.num_copies == 2  # the tiny model has 2 layers; 5 consecutive pages each
    decode.abort("c")


def test_decode_abort_mid_transfer_frees_both_sides(pair):
    prefill, decode = pair(8, prefill_kw={"max_num_batched_tokens": 16})
    prompt = mixed_prompts(1, seed=4, lo=60, hi=60)[0]
    desc = decode.reserve("a", len(prompt))
    prefill.start("a", prompt, GREEDY, desc)
    assert prefill.step() == []  # first 16-token chunk shipped, prefill not done
    free_before = decode.engine.kv.num_free_blocks
    assert decode.abort("a")
    assert decode.engine.kv.num_free_blocks > free_before
    results = []
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        results = prefill.step()
    [result] = results
    assert isinstance(result.error, StaleEpochError)
    assert not prefill.has_pending()


def test_stale_epoch_completion_is_refused(pair):
    prefill, decode = pair(8)
    prompt = [5, 6, 7, 8, 9]
    old = decode.reserve("s", len(prompt))
    decode.abort("s")
    new = decode.reserve("s", len(prompt))
    assert new.epoch != old.epoch
    with pytest.raises(StaleEpochError):
        decode.complete("s", old.epoch, prompt, GREEDY, first_token=1)
    # The old descriptor cannot write either: the shm sender refuses before copying.
    prefill.start("s", prompt, GREEDY, old)
    [result] = prefill.step()
    assert isinstance(result.error, StaleEpochError)
    decode.abort("s")


def assert_refused_before_any_byte_moves(prefill, decode, match: str) -> None:
    """A prefill whose layout differs from the decode pool's is refused at start: nothing queued,
    not a byte of the decode pool changed, the reservation frees cleanly. Closes both."""
    try:
        before = decode.engine.runner.kv_cache.clone()
        desc = decode.reserve("m", 10)
        with pytest.raises(LayoutMismatchError, match=match):
            prefill.start("m", list(range(10)), GREEDY, desc)
        # Compared as bytes: fp8 pools have no torch.equal on CPU.
        assert torch.equal(before.view(torch.uint8), decode.engine.runner.kv_cache.view(torch.uint8))
        assert not prefill.engine.has_unfinished_requests()
        decode.abort("m")
        decode.engine.assert_idle()
    finally:
        prefill.close()
        decode.close()


def test_layout_mismatch_is_refused_before_any_byte_moves(transport, tiny_model_dirs):
    decode = build_decode(config(tiny_model_dirs["llama"], block_size=8), transport)
    prefill = build_prefill(config(tiny_model_dirs["llama"], block_size=16))
    assert_refused_before_any_byte_moves(prefill, decode, "block_size")


def test_lease_expiry_frees_reserved_pages(pair):
    clock = FakeClock()
    prefill, decode = pair(8, lease_ttl_s=5.0, clock=clock)
    free0 = decode.engine.kv.num_free_blocks
    desc = decode.reserve("e", 30)
    assert decode.engine.kv.num_free_blocks < free0
    assert decode.reap_expired() == []
    clock.now += 6
    assert decode.reap_expired() == ["e"]
    assert decode.engine.kv.num_free_blocks == free0
    with pytest.raises(StaleEpochError):
        decode.complete("e", desc.epoch, list(range(30)), GREEDY, first_token=1)


def test_a_renewed_lease_outlives_its_first_deadline(pair, tiny_model_dirs, hf_reference):
    """While its prefill is under way the gateway renews a reservation: a prefill that runs far
    past the first deadline still lands and decodes exactly; a lease that lapsed stays gone."""
    clock = FakeClock()
    prefill, decode = pair(8, prefill_kw={"max_num_batched_tokens": 16}, lease_ttl_s=5.0, clock=clock)
    prompt = mixed_prompts(1, seed=21, lo=40, hi=40)[0]
    desc = decode.reserve("long", len(prompt))
    prefill.start("long", prompt, GREEDY, desc)
    results = []
    while not results:  # 40 tokens in 16-token chunks: 3 steps, 4 "seconds" apart, 12 in all
        clock.now += 4
        assert decode.renew("long", desc.epoch) == 5.0
        assert decode.reap_expired() == []
        results = prefill.step()
    assert clock.now - desc.lease_deadline > 5
    [result] = results
    assert result.error is None, result.error
    out = decode.complete("long", result.epoch, prompt, GREEDY, result.first_token, checksum=result.checksum)
    while not out.finished:
        [out] = decode.engine.step()
    assert out.token_ids == hf_reference(tiny_model_dirs["llama"]).greedy(prompt, 8)

    lapsed = decode.reserve("lapsed", 10)
    clock.now += 6
    with pytest.raises(LeaseExpiredError):
        decode.renew("lapsed", lapsed.epoch)
    assert decode.reap_expired() == ["lapsed"]
    with pytest.raises(StaleEpochError):
        decode.renew("lapsed", lapsed.epoch)


def test_checksum_mismatch_frees_pages_and_says_so(pair):
    prefill, decode = pair(8)
    prompt = mixed_prompts(1, seed=9, lo=20, hi=20)[0]
    desc = decode.reserve("k", len(prompt))
    prefill.start("k", prompt, GREEDY, desc)
    [result] = prefill.step()
    decode.engine.runner.kv_cache[0, 0, desc.block_ids[0], 0] += 1.0  # corrupt one slot
    with pytest.raises(ChecksumMismatchError):
        decode.complete("k", result.epoch, prompt, GREEDY, result.first_token, checksum=result.checksum)


PREFILL_CHILD = textwrap.dedent("""
    import json, sys, time
    from splitserve.engine import EngineConfig, SamplingParams
    from splitserve.worker.wiring import build_prefill
    from splitserve.kvtransfer.base import TransferDescriptor
    model, desc_json, prompt_json = sys.argv[1:4]
    prefill = build_prefill(EngineConfig(model=model, dtype="float32", num_gpu_blocks=128, block_size=8, enforce_eager=True))
    save_layer = prefill.save_layer
    def slow_save_layer(plan, layer):
        save_layer(plan, layer)
        print("layer", layer, flush=True)
        time.sleep(60)  # stalls mid-transfer until killed
    prefill.save_layer = slow_save_layer
    desc = TransferDescriptor.from_dict(json.loads(desc_json))
    prefill.start(desc.request_id, json.loads(prompt_json), SamplingParams(temperature=0, max_tokens=4), desc)
    prefill.step()
""")


def test_prefill_killed_mid_transfer_ends_with_pages_free(pair, tiny_model_dirs):
    import json
    clock = FakeClock()
    prefill, decode = pair(8, lease_ttl_s=30.0, clock=clock)
    free0 = decode.engine.kv.num_free_blocks
    prompt = mixed_prompts(1, seed=5, lo=30, hi=30)[0]
    desc = decode.reserve("k9", len(prompt))
    child = subprocess.Popen([sys.executable, "-c", PREFILL_CHILD, str(tiny_model_dirs["llama"]),
                              json.dumps(desc.to_dict()), json.dumps(prompt)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout.readline().startswith("layer 0")  # layer 0 written, then it stalls
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    clock.now += 31
    assert decode.reap_expired() == ["k9"]
    assert decode.engine.kv.num_free_blocks == free0


PREFILL_PROCESS = textwrap.dedent("""
    import json, sys
    from splitserve.engine import EngineConfig, SamplingParams
    from splitserve.worker.wiring import build_prefill
    from splitserve.kvtransfer.base import TransferDescriptor
    model, jobs_json = sys.argv[1:3]
    device = sys.argv[3] if len(sys.argv) > 3 else "auto"
    prefill = build_prefill(EngineConfig(model=model, dtype="float32", num_gpu_blocks=128, block_size=8,
                                         max_num_batched_tokens=24, enforce_eager=True, device=device),
                            verify_checksum=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for job in json.loads(jobs_json):
        desc = TransferDescriptor.from_dict(job["desc"])
        prefill.start(desc.request_id, job["prompt"], params, desc)
    results = []
    while prefill.has_pending():
        for r in prefill.step():
            results.append({"request_id": r.request_id, "epoch": r.epoch, "first_token": r.first_token,
                            "checksum": r.checksum, "error": str(r.error) if r.error else None,
                            "transport": r.transport})
    prefill.close()
    print(json.dumps(results))
""")


@pytest.mark.parametrize("transport_name", ["shm", "tcp", "nccl"])
def test_handoff_across_processes_equals_transformers(transport_name, tiny_model_dirs, hf_reference):
    """The prefill engine in its own process, as in the product; nccl (gloo on CPU) needs that."""
    import json
    model = tiny_model_dirs["llama"]
    # Nobody renews these leases: they must outlive the child's boot (torch, the model), which
    # took 37 s on a loaded 2-core box, past the default 30 s.
    decode = build_decode(config(model, block_size=8), transport_name, lease_ttl_s=300)
    try:
        prompts = mixed_prompts(4, seed=77, lo=5, hi=50)
        jobs = [{"desc": decode.reserve(f"p{i}", len(p)).to_dict(), "prompt": p} for i, p in enumerate(prompts)]
        child = subprocess.run([sys.executable, "-c", PREFILL_PROCESS, str(model), json.dumps(jobs)],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert child.returncode == 0, child.stderr[-2000:]
        results = json.loads(child.stdout.strip().splitlines()[-1])
        assert len(results) == 4 and all(r["error"] is None for r in results), results
        finished = {}
        for r in results:
            i = int(r["request_id"][1:])
            out = decode.complete(r["request_id"], r["epoch"], prompts[i], GREEDY, r["first_token"],
                                  checksum=r["checksum"])
            if out.finished:
                finished[out.request_id] = out
        while decode.engine.has_unfinished_requests():
            for out in decode.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        ref = hf_reference(model)
        for i, prompt in enumerate(prompts):
            assert finished[f"p{i}"].token_ids == ref.greedy(prompt, 8)
        decode.engine.assert_idle()
        assert len(decode.leases) == 0
    finally:
        decode.close()


def test_auto_offers_fastest_first_and_falls_back_loudly(tiny_model_dirs, hf_reference, caplog):
    import dataclasses
    import logging
    model = tiny_model_dirs["llama"]
    decode = build_decode(config(model, block_size=8), "auto")
    prefill = build_prefill(config(model, block_size=8))
    try:
        assert decode.transports == ["shm", "tcp"]
        prompt = mixed_prompts(1, seed=12, lo=20, hi=20)[0]
        desc = decode.reserve("f", len(prompt))
        assert [t for t, _ in desc.offers] == ["shm", "tcp"]
        # As seen from another host: the shared-memory pool is not there.
        elsewhere = dataclasses.replace(desc, address=str(Path(desc.address).parent / "splitserve-kv-1-00000000"))
        with caplog.at_level(logging.WARNING, logger="splitserve.kvtransfer.prefill_side"):
            prefill.start("f", prompt, GREEDY, elsewhere)
            [result] = prefill.step()
        assert result.error is None and result.transport == "tcp"
        assert "falls back to tcp" in caplog.text and "not reachable" in caplog.text
        out = decode.complete("f", result.epoch, prompt, GREEDY, result.first_token)
        while not out.finished:
            [out] = decode.engine.step()
        assert out.token_ids == hf_reference(model).greedy(prompt, 8)
        # Same host: shm is taken, nothing logged.
        caplog.clear()
        desc = decode.reserve("g", len(prompt))
        with caplog.at_level(logging.WARNING, logger="splitserve.kvtransfer.prefill_side"):
            prefill.start("g", prompt, GREEDY, desc)
            [result] = prefill.step()
        assert result.transport == "shm" and "falls back" not in caplog.text
        decode.abort("g")
        decode.engine.assert_idle()
        prefill.engine.assert_idle()
    finally:
        prefill.close()
        decode.close()


def test_no_usable_transport_is_a_clear_error(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    decode = build_decode(config(model, block_size=8), "shm")
    prefill = build_prefill(config(model, block_size=8), transports=["tcp"])
    try:
        desc = decode.reserve("n", 10)
        with pytest.raises(Exception, match="no offered KV transport"):
            prefill.start("n", list(range(10)), GREEDY, desc)
        assert not prefill.engine.has_unfinished_requests()
        decode.abort("n")
    finally:
        prefill.close()
        decode.close()
