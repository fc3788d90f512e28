"""Prefill, decode and colocated workers as real processes, driven over gRPC on loopback.

The test plays the gateway's part of the protocol: Reserve on the decode worker, Prefill on
the prefill worker (KV goes straight into the reserved pages), Decode to stream the rest.
"""
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.huge_pages import anonymous_bytes, collapse_supported, thp_setting
from splitserve.engine.sampling_params import SamplingParams
from splitserve.wire import sampling_to_worker
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_process, wait_free_pages, worker_info

@pytest.fixture(scope="module")
def workers(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    common = ["--model", model, "--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "96",
              "--max-num-batched-tokens", "64"]
    procs = {}
    try:
        procs["decode"] = start_process(["decode", *common, "--kv-transport", "auto", "--lease-ttl-s", "20"])
        procs["prefill"] = start_process(["prefill", *common, "--verify-checksum"])
        # Its memory in huge pages: the colocated tests below run on it.
        procs["both"] = start_process(["decode", "--role", "both", *common, "--huge-pages"])
        channels = {name: grpc.insecure_channel(addr) for name, (_, addr) in procs.items()}
        yield {
            "model": model,
            "decode": worker_pb2_grpc.DecodeWorkerStub(channels["decode"]),
            "prefill": worker_pb2_grpc.PrefillWorkerStub(channels["prefill"]),
            "both": worker_pb2_grpc.DecodeWorkerStub(channels["both"]),
            "channels": channels,
            "procs": procs,
        }
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def sampling(max_tokens=8, **kw):
    """Resolved sampling, as the gateway sends it (every field set)."""
    return sampling_to_worker(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw))


def disaggregated(w, rid, prompt, params):
    desc = w["decode"].Reserve(worker_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(prompt)),
                               timeout=30).descriptor
    pre = w["prefill"].Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=params,
                                                         descriptor=desc), timeout=60)
    tokens, reason = [pre.first_token], None
    decode = worker_pb2.DecodeRequest(request_id=rid, epoch=pre.epoch, prompt_token_ids=prompt, sampling=params,
                                      first_token=pre.first_token)
    if pre.HasField("checksum"):
        decode.checksum = pre.checksum
    for chunk in w["decode"].Decode(decode, timeout=60):
        tokens.extend(chunk.token_ids)
        if chunk.HasField("finish_reason"):
            reason = chunk.finish_reason
    return tokens, reason, pre


def test_every_worker_reports_serving(workers):
    for name, channel in workers["channels"].items():
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING, name


@pytest.mark.skipif(not collapse_supported(), reason="no MADV_COLLAPSE here (Linux 6.1+, THP not never)")
def test_a_worker_told_to_moves_its_memory_into_huge_pages_and_the_others_keep_small_pages(workers):
    moved, left = (anonymous_bytes(workers["procs"][name][0].pid) for name in ("both", "decode"))
    # A tiny model's worker holds ~300 MiB of anonymous memory (torch, transformers, the model).
    assert moved["AnonHugePages"] >= 64 << 20 and moved["AnonHugePages"] >= moved["Anonymous"] // 4, moved
    if thp_setting() == "madvise":  # (with "always" the kernel gives huge pages unasked)
        assert left["AnonHugePages"] < moved["AnonHugePages"] // 4, (left, moved)  # the default: off


def test_disaggregated_requests_equal_transformers(workers, hf_reference):
    baseline = worker_info(workers["decode"]).kv_blocks_free
    prompts = mixed_prompts(6, seed=61, lo=4, hi=60)
    results = {}

    def run(i):
        results[i] = disaggregated(workers, f"d{i}", prompts[i], sampling(8))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ref = hf_reference(workers["model"])
    for i, prompt in enumerate(prompts):
        tokens, reason, pre = results[i]
        assert tokens == ref.greedy(prompt, 8)
        assert reason == "length"
        assert pre.transport == "shm"  # same host: the fastest offer wins
    wait_free_pages(workers["decode"], baseline)


def test_colocated_worker_equals_transformers(workers, hf_reference):
    prompt = mixed_prompts(1, seed=62, lo=30, hi=30)[0]
    tokens, reason = [], None
    for chunk in workers["both"].Decode(worker_pb2.DecodeRequest(request_id="b1", prompt_token_ids=prompt,
                                                                 sampling=sampling(8)), timeout=60):
        tokens.extend(chunk.token_ids)
        reason = chunk.finish_reason if chunk.HasField("finish_reason") else reason
    assert tokens == hf_reference(workers["model"]).greedy(prompt, 8) and reason == "length"


def test_cancel_mid_stream_frees_pages(workers):
    stub = workers["decode"]
    baseline = worker_info(stub).kv_blocks_free
    prompt = mixed_prompts(1, seed=63, lo=20, hi=20)[0]
    params = sampling(400)
    desc = stub.Reserve(worker_pb2.ReserveRequest(request_id="c1", num_prompt_tokens=len(prompt)), timeout=30).descriptor
    pre = workers["prefill"].Prefill(worker_pb2.PrefillRequest(request_id="c1", prompt_token_ids=prompt,
                                                               sampling=params, descriptor=desc), timeout=60)
    stream = stub.Decode(worker_pb2.DecodeRequest(request_id="c1", epoch=pre.epoch, prompt_token_ids=prompt,
                                                  sampling=params, first_token=pre.first_token), timeout=60)
    next(stream)
    next(stream)
    assert worker_info(stub).kv_blocks_free < baseline
    stream.cancel()
    wait_free_pages(stub, baseline)


def test_deadline_mid_stream_frees_pages(workers):
    stub = workers["both"]
    baseline = worker_info(stub).kv_blocks_free
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Decode(worker_pb2.DecodeRequest(request_id="t1", prompt_token_ids=[1, 2, 3],
                                                      sampling=sampling(100)), timeout=0.3):
            time.sleep(0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_free_pages(stub, baseline)


def test_bad_input_is_invalid_argument(workers):
    cases = [
        lambda: list(workers["decode"].Decode(worker_pb2.DecodeRequest(epoch=1), timeout=10)),
        lambda: workers["prefill"].Prefill(worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1]), timeout=10),
        lambda: workers["decode"].Reserve(worker_pb2.ReserveRequest(request_id="x"), timeout=10),
        lambda: list(workers["both"].Decode(worker_pb2.DecodeRequest(
            request_id="x", prompt_token_ids=[1], sampling=worker_pb2.ResolvedSampling(
                max_tokens=4, temperature=-1, top_p=1, repetition_penalty=1)), timeout=10)),
        lambda: list(workers["both"].Decode(worker_pb2.DecodeRequest(request_id="y", prompt_token_ids=[10_000],
                                                                     sampling=sampling(4)), timeout=10)),
    ]
    for case in cases:
        with pytest.raises(grpc.RpcError) as err:
            case()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert worker_info(workers["both"]).num_running == 0


def test_reserve_without_room_is_resource_exhausted(workers):
    with pytest.raises(grpc.RpcError) as err:
        workers["decode"].Reserve(worker_pb2.ReserveRequest(request_id="big", num_prompt_tokens=96 * 8 + 1), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "500") in tuple(err.value.trailing_metadata())


def test_stale_epoch_is_refused_and_pages_are_freed(workers):
    stub = workers["decode"]
    baseline = worker_info(stub).kv_blocks_free
    desc = stub.Reserve(worker_pb2.ReserveRequest(request_id="s1", num_prompt_tokens=10), timeout=10).descriptor
    assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="s1"), timeout=10).found
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(worker_pb2.DecodeRequest(request_id="s1", epoch=desc.epoch, prompt_token_ids=list(range(10)),
                                                  sampling=sampling(4), first_token=1), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stale" in err.value.details()
    wait_free_pages(stub, baseline)
