"""The engine and the handoff with quantized KV pages (--kv-cache-dtype) on a tiny model.

Quantized pages change the numbers, so greedy output is compared with the unquantized engine
for agreement, reported, not asserted equal; what is asserted is that the pool is quantized,
every request runs to its length, and (handoff) the pages arrive byte for byte.
"""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from kvtransfer import LayoutMismatchError, build_decode, build_prefill
from tests.test_engine_correctness import mixed_prompts
from tests.test_kvtransfer_handoff import handoff

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
    try:
        before = decode.engine.runner.kv_cache.clone()
        desc = decode.reserve("m", 10)
        with pytest.raises(LayoutMismatchError, match="kv_cache_dtype"):
            prefill.start("m", list(range(10)), GREEDY, desc)
        assert torch.equal(before.view(torch.uint8), decode.engine.runner.kv_cache.view(torch.uint8))
        assert not prefill.engine.has_unfinished_requests()
        decode.abort("m")
        decode.engine.assert_idle()
    finally:
        prefill.close()
        decode.close()
