"""The GPU path of kvtransfer (run on a GPU machine; skipped without CUDA).

CUDA forbids opening an IPC handle in the process that exported it, so every cuda_ipc test has
the decode pool in this process and the prefill side in a child process, as in the product. The
tests that need two GPUs (a pair of compose's gpu profiles: prefill on cuda:0, decode on cuda:1)
skip on a machine with one.
"""
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from splitserve.kvtransfer.base import KVLayout, TransferDescriptor, coalesce, kv_checksum

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

SHAPE = (4, 2, 64, 16, 3, 64)

SENDER = textwrap.dedent("""
    import json, sys, torch
    from splitserve.kvtransfer.base import TransferDescriptor, coalesce
    from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcSender
    desc = TransferDescriptor.from_dict(json.loads(sys.argv[1]))
    src_blocks = json.loads(sys.argv[2])
    torch.manual_seed(0)
    src = torch.randn(*json.loads(sys.argv[3]), device=sys.argv[4]).to(torch.bfloat16)
    sender = CudaIpcSender(desc.address, src)
    runs = coalesce(src_blocks, list(desc.block_ids))
    for layer in range(src.shape[0]):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    print(sender.num_copies)
""")


def _child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


@pytest.mark.parametrize("src_device", ["cuda:0", pytest.param("cuda:1", marks=two_gpus)])
@pytest.mark.parametrize("layout", ["contiguous", "every-other", "random"])
def test_cuda_ipc_pages_land_byte_for_byte(layout, src_device):
    """Decode pool on cuda:0 in this process, written from another process (on cuda:0: the single-GPU
    mode; on cuda:1: a cross-device copy through the IPC mapping)."""
    from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0")
    receiver = CudaIpcReceiver.create(pool, lease_ttl_s=60, clock=time.time)
    try:
        rng = random.Random(3)
        src_blocks = list(range(5, 25))
        dst = {"contiguous": list(range(10, 30)), "every-other": list(range(0, 40, 2)),
               "random": rng.sample(range(64), 20)}[layout]
        lease = receiver.leases.grant("g", dst)
        desc = TransferDescriptor("g", "cuda_ipc", receiver.address, tuple(dst), KVLayout.of_pool("m", pool),
                                  lease.epoch, lease.deadline)
        out = subprocess.run([sys.executable, "-c", SENDER, json.dumps(desc.to_dict()), json.dumps(src_blocks),
                              json.dumps(list(SHAPE)), src_device], check=True, timeout=120, env=_child_env(),
                             capture_output=True, text=True)
        assert int(out.stdout.split()[-1]) == SHAPE[0]  # one copy per layer: a run, or one gathered copy
        torch.manual_seed(0)
        expected = torch.randn(*SHAPE, device=src_device).to(torch.bfloat16).to("cuda:0")
        torch.cuda.synchronize()
        assert torch.equal(pool[:, :, dst], expected[:, :, src_blocks])
        untouched = [b for b in range(64) if b not in dst]
        assert not pool[:, :, untouched].any()
    finally:
        receiver.close()


IN_FLIGHT_SENDER = textwrap.dedent("""
    import json, sys, torch
    from splitserve.kvtransfer.base import TransferDescriptor, coalesce
    from splitserve.kvtransfer.page_locks import PageLocks
    from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcSender
    desc = TransferDescriptor.from_dict(json.loads(sys.argv[1]))
    src = torch.ones(*json.loads(sys.argv[2]), dtype=torch.bfloat16, device="cuda")
    sender = CudaIpcSender(desc.address, src)
    from splitserve.kvtransfer.page_copy import page_ids
    decode_side = PageLocks(desc.address + "/owners")  # another open file: excluded as a process is
    runs = tuple(coalesce(list(range(len(desc.block_ids))), list(desc.block_ids)))
    page_ids(runs, "cuda:0")  # the ids on the GPU now: their copy there waits for the stream
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the copies
    for layer in range(src.shape[0]):
        sender.write(desc, layer, runs)
    quiet_in_flight = decode_side.quiet(list(desc.block_ids))
    sender.flush(desc)
    print(json.dumps({"in_flight": quiet_in_flight, "after_flush": decode_side.quiet(list(desc.block_ids))}))
""")


def test_page_locks_stay_held_until_the_copies_land_on_the_device():
    """A write returns before its copies run (no synchronization per layer); until they land the
    decode side cannot take its pages back (page_locks), after the flush it can."""
    from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0")
    receiver = CudaIpcReceiver.create(pool, lease_ttl_s=60, clock=time.time)
    try:
        dst = list(range(8, 28))
        lease = receiver.leases.grant("g", dst)
        desc = TransferDescriptor("g", "cuda_ipc", receiver.address, tuple(dst), KVLayout.of_pool("m", pool),
                                  lease.epoch, lease.deadline)
        out = subprocess.run([sys.executable, "-c", IN_FLIGHT_SENDER, json.dumps(desc.to_dict()),
                              json.dumps(list(SHAPE))], check=True, timeout=120, env=_child_env(),
                             capture_output=True, text=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"in_flight": False, "after_flush": True}
        torch.cuda.synchronize()
        assert bool((pool[:, :, dst] == 1).all())
    finally:
        receiver.close()


def test_engine_handoff_over_cuda_ipc_equals_transformers(tiny_model_dirs, hf_reference):
    """Prefill engine in a child process, decode engine here, one GPU, KV through CUDA IPC on the
    connector's copy stream: greedy output equals transformers."""
    from splitserve.worker.wiring import build_decode
    from tests.test_engine_correctness import mixed_prompts
    from tests.test_kvtransfer_handoff import GREEDY, PREFILL_PROCESS, config
    model = tiny_model_dirs["llama"]
    decode = build_decode(config(model, block_size=8, device="cuda"), "cuda_ipc,tcp")
    try:
        prompts = mixed_prompts(4, seed=77, lo=5, hi=50)
        jobs = [{"desc": decode.reserve(f"p{i}", len(p)).to_dict(), "prompt": p} for i, p in enumerate(prompts)]
        child = subprocess.run([sys.executable, "-c", PREFILL_PROCESS, str(model), json.dumps(jobs), "cuda"],
                               capture_output=True, text=True, timeout=300, env=_child_env())
        assert child.returncode == 0, child.stderr[-3000:]
        results = json.loads(child.stdout.strip().splitlines()[-1])
        assert [r["error"] for r in results] == [None] * 4, results
        assert {r["transport"] for r in results} == {"cuda_ipc"}
        finished = {}
        for r in results:
            i = int(r["request_id"][1:])
            out = decode.complete(r["request_id"], r["epoch"], prompts[i], GREEDY, r["first_token"],
                                  checksum=r["checksum"])  # the CRC is computed on both GPUs' pools
            finished[out.request_id] = out
        while decode.engine.has_unfinished_requests():
            for out in decode.engine.step():
                finished[out.request_id] = out
        ref = hf_reference(model)
        for i, prompt in enumerate(prompts):
            assert finished[f"p{i}"].token_ids == ref.greedy(prompt, 8)
        decode.engine.assert_idle()
    finally:
        decode.close()


def test_kv_checksum_of_a_cuda_pool_equals_its_host_copy():
    pool = torch.randn(3, 2, 20, 8, 2, 16, device="cuda").to(torch.bfloat16)
    blocks = [7, 2, 19, 4]
    for tokens in (8, 29, 32):
        assert kv_checksum(pool, blocks, tokens) == kv_checksum(pool.cpu(), blocks, tokens)


@pytest.mark.parametrize("dst_device", ["cuda:0", pytest.param("cuda:1", marks=two_gpus)])
def test_page_copy_on_and_across_gpus(dst_device):
    from splitserve.kvtransfer.page_copy import copy_runs
    src = torch.randn(2, 64, 16, 3, 64, device="cuda:0").to(torch.bfloat16)
    dst = torch.zeros(2, 64, 16, 3, 64, dtype=torch.bfloat16, device=dst_device)
    rng = random.Random(1)
    src_blocks, dst_blocks = rng.sample(range(64), 30), rng.sample(range(64), 30)
    for pages in (src_blocks[:3], src_blocks):  # slice copies, then one gathered copy
        dst.zero_()
        copy_runs(src, dst, coalesce(pages, dst_blocks[:len(pages)]))
        torch.cuda.synchronize()
        assert torch.equal(dst[:, dst_blocks[:len(pages)]].cpu(), src[:, pages].cpu())


@two_gpus
def test_engine_on_the_second_gpu_stepped_from_another_thread(tiny_model_dirs, hf_reference):
    """A worker on cuda:1 builds its engine on the main thread and steps it on its engine loop's
    thread, whose current device is cuda:0: Triton must still launch on cuda:1."""
    from splitserve.engine import LLM, SamplingParams
    from tests.test_engine_correctness import mixed_prompts
    model = tiny_model_dirs["llama"]
    llm = LLM(model=str(model), dtype="float32", device="cuda:1", enforce_eager=True, num_gpu_blocks=128,
              block_size=16)
    prompts = mixed_prompts(3, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=llm.generate(prompts, params)))
    thread.start()
    thread.join(300)
    ref = hf_reference(model)
    assert [o.token_ids for o in result["out"]] == [ref.greedy(p, 8) for p in prompts]
