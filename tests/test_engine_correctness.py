"""Greedy output of the engine equals transformers `generate(do_sample=False)`, token for token (fp32),
with the step compiled into one graph and op by op (``step_mode``)."""
import random

import pytest

from splitserve.engine import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mixed_prompts(n: int, seed: int, lo: int = 1, hi: int = 60, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches(llm_outputs, prompts, reference, max_tokens=MAX_TOKENS):
    for prompt, out in zip(prompts, llm_outputs):
        assert out.token_ids == reference.greedy(prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch(request):
    return request.param


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_matches_transformers(arch, block_size, tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    prompts = mixed_prompts(18, seed=block_size)
    llm = make_llm(model, block_size=block_size, num_gpu_blocks=256, **step_mode)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches(outputs, prompts, hf_reference(model))


def test_single_prompt(arch, tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    llm = make_llm(model, num_gpu_blocks=16, **step_mode)
    for prompt in ([7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]):
        [out] = llm.generate([prompt], GREEDY)
        assert_matches([out], [prompt], hf_reference(model))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])  # "on": they join while a step is in flight
def test_requests_join_while_others_decode(arch, tiny_model_dirs, make_llm, hf_reference, step_mode, async_scheduling):
    model = tiny_model_dirs[arch]
    llm = make_llm(model, num_gpu_blocks=128, block_size=8, async_scheduling=async_scheduling, **step_mode)
    engine = llm.engine
    prompts = mixed_prompts(6, seed=3)
    done = {}
    engine.add_request("r0", prompts[0], GREEDY)
    engine.add_request("r1", prompts[1], GREEDY)
    step = 0
    while engine.has_unfinished_requests() or step < 6:
        if 2 <= step < 6:  # join mid-decode, one per step
            engine.add_request(f"r{step}", prompts[step], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert_matches([done[f"r{i}"] for i in range(6)], prompts, hf_reference(model))


def test_prefix_cache_hits_give_same_tokens(arch, tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    llm = make_llm(model, block_size=8, num_gpu_blocks=128, enable_prefix_caching=True, **step_mode)
    system = mixed_prompts(1, seed=11, lo=40, hi=40)[0]
    prompts = [system + tail for tail in mixed_prompts(5, seed=12, lo=1, hi=9)]
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in rest)  # 5 full blocks of the shared prompt
    assert_matches(first + rest, prompts, hf_reference(model))
    # The very same prompt again: everything but the last (partial) block is served from cache.
    [again] = llm.generate(prompts[:1], GREEDY)
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 8 * 8
    assert_matches([again], prompts[:1], hf_reference(model))
    assert llm.engine.kv.prefix_stats.hit_rate > 0


def test_chunked_prefill(arch, tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    llm = make_llm(model, block_size=8, num_gpu_blocks=128, max_num_batched_tokens=24, **step_mode)
    prompts = mixed_prompts(5, seed=5, lo=50, hi=90)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches(outputs, prompts, hf_reference(model))


def test_fresh_prefills_off_the_paged_kernel_match_transformers(tiny_model_dirs, make_llm, hf_reference, step_mode,
                                                      monkeypatch):
    """The CPU backend's route for an AMX CPU (fresh prefill chunks off the paged kernel), taken
    here for every dtype and length, in float32 (where the AMX kernel does not run: torch's SDPA
    takes them): a batch of fresh prompts, then prompts over a cached prefix (the kernel's steps)
    give transformers' tokens."""
    from splitserve.engine.attention import cpu_backend
    monkeypatch.setattr(cpu_backend, "amx_prefill_wanted", lambda dtype: True)
    monkeypatch.setattr(cpu_backend, "AMX_MIN_TOKENS", 1)
    monkeypatch.setattr(cpu_backend, "SDPA_MIN_TOKENS", 1)
    routed = []
    chunk_attention = cpu_backend.chunk_attention
    monkeypatch.setattr(cpu_backend, "chunk_attention", lambda *a: (routed.append(1), chunk_attention(*a))[1])
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, block_size=8, num_gpu_blocks=128, enable_prefix_caching=True, **step_mode)
    assert isinstance(llm.engine.runner.backend, cpu_backend.CpuAttentionBackend)
    routed.clear()  # a compiled engine's warm-up step went that way too
    prompts = mixed_prompts(6, seed=31, lo=30, hi=60)
    outputs = llm.generate(prompts, GREEDY)
    assert routed
    again = [prompts[0][:24] + tail for tail in mixed_prompts(3, seed=32, lo=3, hi=9)]
    outputs += llm.generate(again, GREEDY)
    assert all(o.num_cached_tokens == 24 for o in outputs[-3:])
    assert_matches(outputs, prompts + again, hf_reference(model))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_output_exact(arch, mode, tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    # 12 blocks of 8 tokens cannot hold 8 sequences of ~40 tokens at once: preemption must happen.
    llm = make_llm(model, block_size=8, num_gpu_blocks=12, preemption_mode=mode, num_cpu_blocks=64, **step_mode)
    prompts = mixed_prompts(8, seed=21, lo=20, hi=35)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_matches(outputs, prompts, hf_reference(model), max_tokens=16)


def test_static_batching_matches_and_pays_for_padding(tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, block_size=8, num_gpu_blocks=256, batching="static", static_batch_size=4)
    prompts = mixed_prompts(8, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 12) * 4]
    engine = llm.engine
    row_tokens = 0
    ids = [engine.add_request(None, p, sp).request_id for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        plan_rows = engine.scheduler.schedule()
        row_tokens += sum(c.num_tokens for c in plan_rows.chunks if c.is_decode)
        sampled = engine.runner.run(plan_rows)
        for r in engine.scheduler.update(plan_rows, sampled):
            if r.is_finished:
                done[r.request_id] = engine.request_output(r)
    engine.scheduler.schedule()  # lets the last batch go
    for prompt, sp, rid in zip(prompts, params, ids):
        assert done[rid].token_ids == hf_reference(model).greedy(prompt, sp.max_tokens)
    useful_decodes = sum(sp.max_tokens - 1 for sp in params)
    # Each batch of 4 runs to its longest member (12 tokens): 2 batches x 4 rows x 11 decode steps.
    assert row_tokens == 2 * 4 * 11 > useful_decodes


def test_triton_backend_matches_transformers(tiny_model_dirs, make_llm, hf_reference):
    """The engine on the Triton kernels (interpreted on CPU) still equals transformers."""
    from splitserve.engine.attention import triton_kernels
    if not triton_kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    if not triton_kernels._INTERPRETED and not __import__("torch").cuda.is_available():
        pytest.skip("compiled Triton needs CUDA; set TRITON_INTERPRET=1 to run it on CPU")
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, block_size=8, num_gpu_blocks=32, attention_backend="triton",
                   max_num_batched_tokens=16)  # chunked prefill + decodes in mixed steps
    prompts = mixed_prompts(3, seed=31, lo=3, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert_matches(llm.generate(prompts, params), prompts, hf_reference(model), max_tokens=4)


def test_cuda_graph_sizes_cover_every_decode_batch():
    from splitserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    graphs = DecodeGraphs(None, None, [], None, 1024, capture_sizes(20))
    assert [graphs.padded_size(n) for n in (1, 3, 5, 17, 20, 21)] == [1, 4, 8, 20, 20, None]


@pytest.mark.gpu
def test_cuda_graph_decode_matches_transformers(tiny_model_dirs, make_llm, hf_reference):
    """Compiled forward + CUDA graphs on the GPU: decode steps replay graphs, output stays exact."""
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, device="cuda", enforce_eager=False, block_size=16, num_gpu_blocks=256, max_num_seqs=16)
    runner = llm.engine.runner
    assert runner.graphs is not None and set(runner.graphs.graphs) == {1, 2, 4, 8, 16}
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda n, size: replays.append((n, size)) or original(n, size)
    prompts = mixed_prompts(11, seed=41)
    assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(model))
    assert (11, 16) in replays  # eleven decodes padded to the graph of sixteen


def test_requests_reuse_the_graph_compiled_at_start_up(tiny_model_dirs, make_llm):
    # The warm-up step must pass every guard a real step checks: a recompile on the first
    # request costs its TTFT the whole compile time.
    import torch
    # Steps after warm-up skip the guards (compiled_forward._STANCE_LOCK); that is safe because
    # they would pass them, which this checks with the guards evaluated.
    torch._dynamo.reset()  # no graph an earlier test's real steps compiled
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=64, enforce_eager=False)
    assert llm.engine.runner.forward.skip_guards
    llm.engine.runner.forward.skip_guards = False
    prompts = mixed_prompts(4, seed=21)
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs = llm.generate(prompts, GREEDY)
    assert [len(o.token_ids) for o in outputs] == [MAX_TOKENS] * 4


def test_the_cpu_graph_runs_under_inductors_cpp_wrapper_unless_turned_off(tiny_model_dirs, make_llm, monkeypatch):
    import torch
    from splitserve.engine.compiled_forward import cpp_wrapper_wanted
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)  # the suite's own setting (tests/conftest.py)
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=64, enforce_eager=False, device="cpu")
    assert llm.engine.runner.forward.options == {"cpp_wrapper": True}
    assert not cpp_wrapper_wanted(torch.device("cuda"))
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    assert not cpp_wrapper_wanted(torch.device("cpu"))


def test_compiled_engines_of_different_models_share_a_process(tiny_model_dirs, make_llm, hf_reference):
    """Guards are skipped after warm-up; each engine must still run its own model's graph, with
    engines of three architectures compiled one after another and stepped in turn."""
    llms = {arch: make_llm(tiny_model_dirs[arch], num_gpu_blocks=64, enforce_eager=False)
            for arch in ("llama", "qwen2", "mistral")}
    for seed, (arch, llm) in enumerate([*llms.items(), *llms.items()]):
        prompts = mixed_prompts(3, seed=60 + seed)
        assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(tiny_model_dirs[arch]))


def test_compiled_engines_of_more_models_than_dynamos_recompile_limit(tiny_model_dirs, make_llm, hf_reference):
    """dynamo counts recompiles per code object: with one forward code object for every engine, the
    engine of a ninth model in a process (a notebook, a test run, ``tune``) failed with
    FailOnRecompileLimitHit. Here the limit is 1 and engines of three models are built, each exact;
    a second engine of a model reuses the first one's graph."""
    import torch
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed, arch in enumerate(("llama", "qwen2", "mistral", "llama")):
            llm = make_llm(tiny_model_dirs[arch], num_gpu_blocks=64, enforce_eager=False)
            prompts = mixed_prompts(2, seed=80 + seed)
            assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(tiny_model_dirs[arch]))
    assert llm.engine.runner.forward.warmup_s < 0.5  # the llama graph again, not a compile
