"""LoRA adapters through a real disaggregated stack (Redis, a gateway, a prefill and a decode
worker started with --enable-lora --lora-modules): a tiny random Llama and two PEFT adapters of
it. Each request's greedy output equals transformers' on the model PEFT merges (fp32), over gRPC
and the OpenAI HTTP API, alone and concurrently with the other adapter and the base model; the
prefill worker computes the prompt under the adapter and the decode worker continues under it."""
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from splitserve.v1 import generation_pb2
from tests.harness.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.harness.stack import start_stack
from tests.harness.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 13, 21, 34, 55, 89, 2, 9, 4, 6, 1, 70, 71], [11, 12, 13, 14, 15],
           [200, 150, 100, 50, 25, 12, 6, 3, 1, 2, 4, 8, 16, 32, 64, 128, 250, 240, 230]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-service")
    base = make_tiny_model(root / "base", seed=5)
    return {"base": base,
            "a": make_adapter(base, root / "a", 11, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
            "b": make_adapter(base, root / "b", 12, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    modules = f"a={models['a'][0]},b={models['b'][0]}"
    running = start_stack(models["base"], tmp_path_factory, prefill=1, decode=1, http=True,
                          worker_args=["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                                       "--lora-modules", modules])
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def expected(models, hf_reference):
    dirs = {None: models["base"], "a": models["a"][1], "b": models["b"][1]}
    return {name: [hf_reference(path).greedy(p, MAX_TOKENS) for p in PROMPTS] for name, path in dirs.items()}


def generate(stack, prompt, lora: str | None):
    request = generation_pb2.GenerateRequest(token_ids=prompt, lora=lora or "", sampling=generation_pb2.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    messages = list(stack.stub.Generate(request, timeout=120))
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids], messages[-1].final


def test_each_adapter_through_the_handoff_equals_the_merged_model(stack, expected):
    for name in ("a", "b", None):
        for i, prompt in enumerate(PROMPTS):
            tokens, final = generate(stack, prompt, name)
            assert tokens == expected[name][i], (name, i)
            assert final.timeline.prefill_worker and final.timeline.decode_worker  # the disaggregated path ran
    assert expected["a"] != expected[None] and expected["b"] != expected[None]


def test_concurrent_requests_of_both_adapters_and_the_base(stack, expected):
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a", "b", None)] * 2
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda job: generate(stack, PROMPTS[job[1]], job[0])[0], jobs))
    for (name, i), tokens in zip(jobs, results):
        assert tokens == expected[name][i], (name, i)


def test_a_prompt_cached_under_one_adapter_is_computed_again_under_another(stack, expected):
    prompt = PROMPTS[2]
    for name in ("a", "a", "b", None):
        tokens, final = generate(stack, prompt, name)
        assert tokens == expected[name][2], name
    tokens, final = generate(stack, prompt, "b")  # its own blocks are reused
    assert tokens == expected["b"][2] and final.usage.cached_prompt_tokens > 0


def test_http_model_names_the_adapter_and_models_lists_them(stack, expected, models):
    listed = httpx.get(stack.http + "/v1/models", timeout=10).json()["data"]
    base = listed[0]["id"]
    assert [(m["id"], m.get("parent")) for m in listed[1:]] == [("a", base), ("b", base)]
    for name in ("a", "b"):
        got = httpx.post(stack.http + "/v1/completions", timeout=60, json={
            "model": name, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert "error" not in got, got
        assert got["model"] == name and got["choices"][0]["token_ids"] == expected[name][1]
    missing = httpx.post(stack.http + "/v1/completions", timeout=10, json={"model": "c", "prompt": [1, 2]})
    assert missing.status_code == 404 and "'a', 'b'" in missing.json()["error"]["message"]


def test_an_adapter_no_worker_serves_is_not_found_and_workers_list_theirs(stack):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, PROMPTS[1], "c")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "served: a, b" in err.value.details()
    info = stack.stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10)
    assert {w.role: list(w.loras) for w in info.workers if w.role != "gateway"} == \
        {"prefill": ["a", "b"], "decode": ["a", "b"]}


def test_an_adapter_loaded_and_unloaded_while_requests_run(stack, models, expected, tmp_path):
    """Hot load under traffic: base requests keep coming while "c" is loaded (over HTTP, as vLLM's
    endpoint), served, refused as a duplicate, unloaded over gRPC, then NOT_FOUND; the base
    requests all equal the reference throughout."""
    c_adapter, c_merged = make_adapter(models["base"], tmp_path / "c", 13, r=4, lora_alpha=8,
                                       target_modules=["o_proj", "up_proj"])
    stop, base_results = [], []

    def traffic():
        while not stop:
            base_results.append(generate(stack, PROMPTS[1], None)[0])
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(traffic)
        loaded = httpx.post(stack.http + "/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": "c", "lora_path": str(c_adapter)})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        from tests.conftest import HFReference
        assert generate(stack, PROMPTS[0], "c")[0] == HFReference(c_merged).greedy(PROMPTS[0], MAX_TOKENS)
        again = httpx.post(stack.http + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "c", "lora_path": str(c_adapter)})
        assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]
        response = stack.stub.UnloadLoRAAdapter(generation_pb2.UnloadLoRAAdapterRequest(lora_name="c"), timeout=60)
        assert len(response.worker_ids) == 2
        stop.append(True)
        running.result(timeout=120)
    assert base_results and all(tokens == expected[None][1] for tokens in base_results)
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, PROMPTS[1], "c")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_loading_refusals_name_the_problem(stack, models, tmp_path):
    bad = tmp_path / "bad"
    big, _ = make_adapter(models["base"], bad, 14, r=16, lora_alpha=16, target_modules=["q_proj"])
    cases = [({"lora_name": "big", "lora_path": str(big)}, 400, "above this server's --max-lora-rank (8)"),
             ({"lora_name": "nowhere", "lora_path": str(tmp_path / "nowhere")}, 400, "no adapter_config.json"),
             ({"lora_name": "a", "lora_path": str(models["a"][0])}, 409, "already loaded")]
    for body, status, words in cases:
        got = httpx.post(stack.http + "/v1/load_lora_adapter", json=body, timeout=60)
        assert got.status_code == status and words in got.json()["error"]["message"], got.text
    missing = httpx.post(stack.http + "/v1/unload_lora_adapter", json={"lora_name": "zz"}, timeout=60)
    assert missing.status_code == 404
    listed = [m["id"] for m in httpx.get(stack.http + "/v1/models", timeout=10).json()["data"][1:]]
    assert listed == ["a", "b"]  # a refused load left nothing behind on any worker


def test_more_adapters_at_once_than_slots_wait_their_turn(stack, models, expected, tmp_path):
    """Three adapters, two slots per worker (--max-loras 2): requests of all three at once. Those
    whose adapter finds no free slot wait (in the prefill worker's queue, and with their pages
    reserved on the decode worker) until requests of another adapter end; every one is served,
    exact."""
    from tests.conftest import HFReference
    d_adapter, d_merged = make_adapter(models["base"], tmp_path / "d", 15, r=8, lora_alpha=8,
                                       target_modules=["k_proj", "gate_proj"])
    stack.stub.LoadLoRAAdapter(generation_pb2.LoadLoRAAdapterRequest(lora_name="d", lora_path=str(d_adapter)),
                               timeout=60)
    want = {**{name: expected[name] for name in ("a", "b")},
            "d": [HFReference(d_merged).greedy(p, MAX_TOKENS) for p in PROMPTS]}
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a", "b", "d")] * 2
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: generate(stack, PROMPTS[job[1]], job[0])[0], jobs))
    finally:
        stack.stub.UnloadLoRAAdapter(generation_pb2.UnloadLoRAAdapterRequest(lora_name="d"), timeout=60)
    for (name, i), tokens in zip(jobs, results):
        assert tokens == want[name][i], (name, i)
