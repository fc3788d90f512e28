"""LoRA adapters in the engine: two random adapters made with PEFT on a tiny random Llama, served
beside the base model. Each adapter's greedy output equals transformers' on the model PEFT merges
(fp32), alone and in one batch with the base model and the other adapter; prefix-cache blocks are
never shared across adapters; what PEFT can write but the engine does not serve is refused."""
import dataclasses
import json

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.lora.layers import GroupedRows, MaskedRows, TokenSlots
from tests.harness.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.harness.tiny_models import make_tiny_model
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 13, 21, 34, 55, 89, 2, 9, 4, 6, 1, 70, 71], [11, 12, 13], [200, 150, 100, 50]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", seed=3)
    a = make_adapter(base, root / "a", 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)
    b = make_adapter(base, root / "b", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True)
    return {"base": base, "a": a, "b": b, "root": root}


@pytest.fixture(scope="module")
def llm(dirs):
    llm = LLM(model=str(dirs["base"]), dtype="float32", num_gpu_blocks=128, block_size=4, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    llm.add_lora("a", dirs["a"][0])
    llm.add_lora("b", dirs["b"][0])
    yield llm
    llm.engine.assert_idle()


@pytest.fixture(scope="module")
def expected(dirs, hf_reference):
    """Per adapter (None: the base model), transformers' greedy tokens of each prompt."""
    models = {None: dirs["base"], "a": dirs["a"][1], "b": dirs["b"][1]}
    return {name: [hf_reference(path).greedy(p, GREEDY.max_tokens) for p in PROMPTS] for name, path in models.items()}


def test_each_adapter_alone_equals_the_merged_model(llm, expected):
    for name in ("a", "b", None):
        outs = llm.generate(PROMPTS, GREEDY, lora=name)
        assert [o.token_ids for o in outs] == expected[name], name
    assert expected["a"] != expected[None] and expected["b"] != expected[None]  # the adapters change the output


def test_base_and_both_adapters_share_one_batch(llm, expected):
    """Nine requests, three per adapter, interleaved, so every step mixes them."""
    names = [None, "a", "b"] * 3
    prompts = [PROMPTS[i // 3] for i in range(9)]
    outs = llm.generate(prompts, GREEDY, lora=names)
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.token_ids == expected[name][i // 3], (i, name)


def test_prefix_cache_blocks_belong_to_their_adapter(llm, dirs, hf_reference):
    """A prompt no earlier test sent: under "a" twice (the second reuses its blocks), then under
    "b" and the base model, which find none of them."""
    prompt = [250, 3, 250, 4, 250, 5, 250, 6, 250, 7, 250, 8, 1]
    first = llm.generate([prompt], GREEDY, lora="a")[0]
    again = llm.generate([prompt], GREEDY, lora="a")[0]
    other = llm.generate([prompt], GREEDY, lora="b")[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 12)  # three full blocks of four
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # never another adapter's
    want = {name: hf_reference(path).greedy(prompt, GREEDY.max_tokens)
            for name, path in (("a", dirs["a"][1]), ("b", dirs["b"][1]), (None, dirs["base"]))}
    assert (first.token_ids, again.token_ids, other.token_ids, base.token_ids) == \
        (want["a"], want["a"], want["b"], want[None])


def test_slots_are_reused_least_recently_used_first(dirs, expected):
    """One slot, two adapters: each request loads its adapter into the slot in turn."""
    llm = LLM(model=str(dirs["base"]), dtype="float32", num_gpu_blocks=64, block_size=4, enable_lora=True,
              max_loras=1, max_lora_rank=8, enforce_eager=True)
    llm.add_lora("a", dirs["a"][0])
    llm.add_lora("b", dirs["b"][0])
    for name in ("a", "b", "a", None, "b"):
        assert llm.generate([PROMPTS[1]], GREEDY, lora=name)[0].token_ids == expected[name][1], name
    # Both at once need two slots: the second waits in the queue while the first runs, then runs
    # in the slot the first gave back; neither is mixed up with the other's adapter.
    engine = llm.engine
    engine.add_request("holds-a", PROMPTS[1], dataclasses.replace(GREEDY, lora="a"))
    engine.add_request("wants-b", PROMPTS[1], dataclasses.replace(GREEDY, lora="b"))
    finished, first_token_step, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = (step, out.token_ids)
    assert finished["holds-a"][1] == expected["a"][1] and finished["wants-b"][1] == expected["b"][1]
    assert first_token_step["wants-b"] > finished["holds-a"][0]  # it waited for the slot
    assert engine.scheduler.num_deferred_for_lora > 0
    engine.assert_idle()
    assert not engine.runner.lora.users


def test_an_adapter_is_not_unloaded_under_a_request_that_waits_for_a_slot(dirs):
    from splitserve.engine.lora.manager import AdapterInUse
    llm = LLM(model=str(dirs["base"]), dtype="float32", num_gpu_blocks=64, block_size=4, enable_lora=True,
              max_loras=1, max_lora_rank=8, enforce_eager=True)
    llm.add_lora("a", dirs["a"][0])
    llm.add_lora("b", dirs["b"][0])
    engine = llm.engine
    engine.add_request("holds-a", PROMPTS[1], dataclasses.replace(GREEDY, lora="a"))
    engine.add_request("wants-b", PROMPTS[1], dataclasses.replace(GREEDY, lora="b"))
    engine.step()  # "holds-a" runs; "wants-b" waits, holding no slot
    assert engine.requests["wants-b"].lora_slot is None
    with pytest.raises(AdapterInUse, match="1 request"):
        engine.remove_lora("b")
    with pytest.raises(ValueError, match="'zz' is not loaded here"):
        engine.add_request("unknown", PROMPTS[1], dataclasses.replace(GREEDY, lora="zz"))
    engine.abort_request("wants-b")
    engine.remove_lora("b")
    engine.abort_request("holds-a")
    engine.assert_idle()
    assert not engine.runner.lora.users


def write_adapter(path, config: dict, tensors: dict):
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_adapters_that_do_not_fit_are_refused_by_name(llm, dirs):
    root = dirs["root"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    write_adapter(root / "rank32", {"r": 32}, {key.format("A"): torch.zeros(32, 64), key.format("B"): torch.zeros(64, 32)})
    write_adapter(root / "wide", {}, {key.format("A"): torch.zeros(4, 96), key.format("B"): torch.zeros(96, 4)})
    write_adapter(root / "dora", {"use_dora": True}, {key.format("A"): torch.zeros(4, 64),
                                                      key.format("B"): torch.zeros(64, 4)})
    write_adapter(root / "embed", {}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)})
    cases = {"rank32": "rank 32 is above this server's --max-lora-rank", "wide": "another base model",
             "dora": "DoRA", "embed": "not a LoRA A or B matrix"}
    for name, words in cases.items():
        with pytest.raises(ValueError, match=words):
            llm.add_lora(name, root / name)
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora("a", dirs["a"][0])
    with pytest.raises(ValueError, match="not loaded here"):
        llm.generate([PROMPTS[1]], GREEDY, lora="nope")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.add_lora("missing", root / "nowhere")
    assert sorted(llm.engine.list_loras()) == ["a", "b"]


def test_an_engine_without_lora_refuses_adapters(dirs):
    llm = LLM(model=str(dirs["base"]), dtype="float32", num_gpu_blocks=16, block_size=4, enforce_eager=True)
    with pytest.raises(ValueError, match="serves no adapters"):
        llm.generate([PROMPTS[1]], GREEDY, lora="a")
    llm.engine.assert_idle()


def test_an_adapters_chain_root_is_the_same_in_every_process():
    """The prefill and decode workers must agree on an adapter's block hashes; Python's hash of a
    string differs per process."""
    import subprocess
    import sys
    code = "from splitserve.engine.block_pool import chain_root; print(chain_root('sql'))"
    roots = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    from splitserve.engine.block_pool import chain_root
    assert roots == {str(chain_root("sql"))}


def test_the_triton_grouped_gemms_serve_each_adapter_and_mixed_batches(dirs, expected):
    """With the Triton kernels (interpreted on CPU, compiled on a GPU) each token goes through its
    own adapter's A and B in grouped-GEMM launches instead of the masked stack of every slot: a
    batch mixing the base model and both adapters equals transformers + PEFT (eager on CPU: the
    compiled layer is checked on its own below)."""
    from splitserve.engine.attention.triton_common import _INTERPRETED, TRITON_AVAILABLE
    if not TRITON_AVAILABLE or not (_INTERPRETED or torch.cuda.is_available()):
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    llm = LLM(model=str(dirs["base"]), dtype="float32", num_gpu_blocks=128, block_size=4, enable_lora=True,
              max_loras=2, max_lora_rank=8, attention_backend="triton", enforce_eager=not torch.cuda.is_available(),
              device="cuda" if torch.cuda.is_available() else "cpu")
    assert isinstance(llm.engine.runner.lora.rows, GroupedRows)
    llm.add_lora("a", dirs["a"][0])
    llm.add_lora("b", dirs["b"][0])
    short = dataclasses.replace(GREEDY, max_tokens=6)
    names = [None, "a", "b", "a", "b", None]
    outs = llm.generate([PROMPTS[i % 3] for i in range(6)], short, lora=names)
    assert [o.token_ids for o in outs] == [expected[name][i % 3][:6] for i, name in enumerate(names)]
    llm.engine.assert_idle()


def _rows_of(kind: str, slots: int, rank: int, dtype: torch.dtype, device: str):
    from splitserve.engine.attention import cpu_kernels
    from splitserve.engine.attention.triton_common import _INTERPRETED, TRITON_AVAILABLE
    from splitserve.engine.lora import manager
    if kind == "grouped":
        if not TRITON_AVAILABLE or not (_INTERPRETED or torch.cuda.is_available()):
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
        return GroupedRows(2048, slots, rank, torch.device(device))
    if kind == "kernel":
        if device != "cpu" or not cpu_kernels.available():
            pytest.skip("the C++ kernel is the CPU's, where it builds")
        assert manager._cpu_kernel_ready()
        return TokenSlots(2048, slots, rank, torch.device(device))
    return MaskedRows(2048, slots, rank, dtype, torch.device(device))


# Runs of one slot as a step has them: prefill chunks, decode tokens of alternating slots, the
# base model's tokens between them. The C++ kernel's loops take them all; with a 1,030-token run of
# rank 8 at the end, its GEMM path too (csrc/lora_cpu.cpp, kGemmWork).
SLOT_RUNS = [(None, 3), (1, 20), (0, 1), (2, 1), (None, 1), (0, 1), (1, 2), (2, 17), (None, 5), (0, 16), (1, 1)]
LONG_RUN = [(1, 1030), (0, 2)]


@pytest.mark.parametrize("kind,dtype", [("kernel", torch.float32), ("kernel", torch.bfloat16),
                                        ("masked", torch.float32), ("grouped", torch.float32)])
def test_each_token_gets_its_own_adapters_update_compiled(kind, dtype):
    """One LoRALinear under torch.compile (token count dynamic, the kernels opaque), for a step
    mixing the base model and three slots in long and short runs: each token's output is the base
    projection plus its own slot's x @ A.T @ B (exactly the base projection for the base model's
    tokens), against that sum in float64; a slot's rows past an adapter's rank are zero."""
    from splitserve.engine.lora.layers import LoRALinear
    device = "cuda" if kind == "grouped" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    slots, rank, width_in, width_out = 3, 8, 40, 56  # widths off the kernel's 16 lanes: its tails too
    rows = _rows_of(kind, slots, rank, dtype, device)
    base = torch.nn.Linear(width_in, width_out, bias=False).to(device, dtype)
    layer = LoRALinear(base, width_in, width_out, rows, slots, dtype, torch.device(device))
    a = torch.randn(slots * rank, width_in, generator=g)
    b = torch.randn(slots * rank, width_out, generator=g)
    a[2 * rank + 5:], b[2 * rank + 5:] = 0, 0  # slot 2: an adapter of rank 5
    layer.lora_a.copy_(a), layer.lora_b.copy_(b)
    slot_of_token = [s for s, count in SLOT_RUNS + (LONG_RUN if kind == "kernel" else []) for _ in range(count)]
    rows.write(slot_of_token)
    x = torch.randn(len(slot_of_token), width_in, generator=g).to(device, dtype)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got = compiled(x).double().cpu()
        base_out = base(x).double().cpu()
    x64, a64, b64 = x.double().cpu(), layer.lora_a.double().cpu(), layer.lora_b.double().cpu()
    # bf16: the shrunk values of the GEMM path round to bf16 before the expand; ~1 % of the row
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * base_out.abs().max().item() + 0.5
    for t, s in enumerate(slot_of_token):
        want = base_out[t] if s is None else \
            base_out[t] + x64[t] @ a64[s * rank:(s + 1) * rank].T @ b64[s * rank:(s + 1) * rank]
        assert torch.allclose(got[t], want, atol=tolerance, rtol=1e-4 if dtype == torch.float32 else 2e-2), (t, s)
        if s is None:
            assert torch.equal(got[t], base_out[t])
