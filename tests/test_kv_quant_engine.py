"""The engine and the handoff with quantized KV pages (--kv-cache-dtype) on a tiny model.

Quantized pages change the numbers, so greedy output is compared with the unquantized engine
for agreement, reported, not asserted equal; what is asserted is that the pool is quantized,
every request runs to its length, and (handoff) the pages arrive byte for byte.
"""
import pytest

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.worker.wiring import build_decode, build_prefill
from tests.test_engine_correctness import mixed_prompts
from tests.test_kvtransfer_handoff import assert_refused_before_any_byte_moves, handoff

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def agreement(a, b) -> float:
    """Share of positions where two lists of outputs hold the same token."""
    pairs = [(x, y) for oa, ob in zip(a, b) for x, y in zip(oa.token_ids, ob.token_ids)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_greedy_with_quantized_pages_runs_and_mostly_agrees(kv_cache_dtype, attention_backend, tiny_model_dirs,
                                                            make_llm):
    model = tiny_model_dirs["llama"]
    # A small step budget chunks the longer prompts: later chunks read earlier quantized pages.
    kw = dict(block_size=8, num_gpu_blocks=128, attention_backend=attention_backend, max_num_batched_tokens=32)
    prompts = mixed_prompts(8, seed=5, lo=3, hi=50)
    base = make_llm(model, **kw).generate(prompts, GREEDY)
    llm = make_llm(model, kv_cache_dtype=kv_cache_dtype, **kw)
    assert llm.engine.runner.kv_cache.dtype == llm.engine.runner.kv_quant.storage
    quant = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in quant)
    share = agreement(base, quant)
    print(f"greedy agreement {kv_cache_dtype} vs auto ({attention_backend}): {share:.2%}")


def test_compiled_step_reads_quantized_pages(tiny_model_dirs, make_llm):
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(4, seed=9, lo=3, hi=30)
    eager = make_llm(model, block_size=8, num_gpu_blocks=64, kv_cache_dtype="int8").generate(prompts, GREEDY)
    compiled = make_llm(model, block_size=8, num_gpu_blocks=64, kv_cache_dtype="int8",
                        enforce_eager=False).generate(prompts, GREEDY)
    print(f"greedy agreement int8 compiled vs eager: {agreement(eager, compiled):.2%}")
    assert all(len(o.token_ids) == 8 for o in compiled)


def _config(model, **kw):
    return EngineConfig(model=str(model), dtype="float32", block_size=8, num_gpu_blocks=96, enforce_eager=True, **kw)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_quantized_pages_hand_off_byte_for_byte(transport, tiny_model_dirs, make_llm):
    model = tiny_model_dirs["llama"]
    decode = build_decode(_config(model, kv_cache_dtype="int8"), transport)
    prefill = build_prefill(_config(model, kv_cache_dtype="int8", max_num_batched_tokens=24), verify_checksum=True)
    try:
        prompts = mixed_prompts(4, seed=11, lo=3, hi=45)
        # verify_checksum: the decode side compares a CRC of the pages with the prefill side's.
        outputs, descs = handoff(prefill, decode, prompts)
        assert all(d.layout.kv_cache_dtype == "int8" for d in descs.values())
        colocated = make_llm(model, block_size=8, num_gpu_blocks=96, kv_cache_dtype="int8").generate(prompts, GREEDY)
        print(f"greedy agreement int8 handoff vs colocated int8: {agreement(colocated, outputs):.2%}")
        assert all(len(o.token_ids) == 8 for o in outputs)
        prefill.engine.assert_idle()
        decode.engine.assert_idle()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("prefill_kv, decode_kv", [("int8", "auto"), ("auto", "fp8"), ("fp8", "int8")])
def test_mismatched_kv_dtypes_are_refused_before_any_byte_moves(prefill_kv, decode_kv, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    decode = build_decode(_config(model, kv_cache_dtype=decode_kv), "tcp")
    prefill = build_prefill(_config(model, kv_cache_dtype=prefill_kv))
    assert_refused_before_any_byte_moves(prefill, decode, "kv_cache_dtype")


def test_capacity_nearly_doubles_and_sizing_and_worker_info_agree(tiny_model_dirs, make_llm):
    """Pages per GiB: the engine's pool, splitserve.cli.sizing and GetWorkerInfo say the same, and
    8-bit pages give 2 * head_dim / (head_dim + 4) times bf16's (the scale costs 4 B a row)."""
    from splitserve.wire import worker_info_to_proto
    from splitserve.cli.sizing import load_shape, pages_for

    model = tiny_model_dirs["llama"]
    shape = load_shape(str(model))
    budget = 0.01
    pools = {}
    for kv in ("auto", "int8", "fp8"):
        llm = make_llm(model, dtype="bfloat16", kv_cache_memory_gb=budget, kv_cache_dtype=kv)
        runner = llm.engine.runner
        assert runner.num_blocks == pages_for(budget, shape, "bfloat16", runner.block_size, kv)
        info = worker_info_to_proto("w", "decode", "a:1", ["tcp"], llm.engine.stats())
        assert info.kv_cache_dtype == kv and info.kv_blocks_total == runner.num_blocks
        assert info.kv_page_bytes == runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
        pools[kv] = runner.num_blocks
    d = shape.head_dim  # 16 here: 1.6x
    for kv in ("int8", "fp8"):
        assert pools[kv] / pools["auto"] == pytest.approx(2 * d / (d + 4), rel=0.01), pools


@pytest.mark.parametrize("head_dim, at_least", [(64, 1.88), (128, 1.93)])
def test_sizing_pages_per_gib_about_double_bf16(head_dim, at_least):
    from splitserve.cli.sizing import KVShape, pages_for
    shape = KVShape("m", 30, 3, head_dim)  # SmolLM2's shape at 64
    ratio = pages_for(20, shape, "bfloat16", 16, "int8") / pages_for(20, shape, "bfloat16", 16)
    assert at_least <= ratio < 2


def test_swapped_out_quantized_pages_come_back_as_they_were(tiny_model_dirs, make_llm):
    """Swap preemption moves fp8 pages (codes and scales) to the host pool and back as bytes: the
    output equals that of an engine with room for everyone."""
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(8, seed=21, lo=20, hi=35)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    roomy = make_llm(model, block_size=8, num_gpu_blocks=256, kv_cache_dtype="fp8").generate(prompts, params)
    llm = make_llm(model, block_size=8, num_gpu_blocks=12, preemption_mode="swap", num_cpu_blocks=64,
                   kv_cache_dtype="fp8")
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]


def test_config_names_the_kv_cache_dtypes():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
