"""The rotary cos/sin table (splitserve/engine/rotary_cache.py): every family's rotary module is
swapped for a lookup that returns what the module computes, bit for bit; rotary types whose
frequencies follow the sequence length keep computing. That the engine's greedy tokens still
equal transformers' with the tables in place is tests/test_model_families.py's check."""
from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.rotary_cache import CachedRotaryEmbedding, cache_rotary_embeddings
from tests.harness.model_families import FAMILIES, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MAX_POSITIONS

LENGTH = 512


def tiny_model(name: str, **overrides) -> torch.nn.Module:
    config_class, extra = FAMILIES[name]
    common = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs = {k: v for k, v in {**common, **extra, **overrides}.items() if v is not None or k not in common}
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs)).eval()


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "rope_type") and not isinstance(m, CachedRotaryEmbedding)]


def live_and_cached(name: str, dtype: torch.dtype, **overrides):
    model = tiny_model(name, **overrides).to(dtype)
    originals = rotary_modules(model)
    swapped = cache_rotary_embeddings(model, LENGTH, dtype, torch.device("cpu"))
    cached = [m for m in model.modules() if isinstance(m, CachedRotaryEmbedding)]
    return originals, swapped, cached


def layer_types_of(module) -> list:
    return list(module.rope_type) if isinstance(module.rope_type, dict) else [None]


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_looks_up_what_its_module_computes(name, dtype):
    originals, swapped, cached = live_and_cached(name, dtype)
    assert originals, f"{name} has no rotary module: the test would check nothing"
    assert swapped == len(originals) == len(cached)
    positions = torch.randint(0, LENGTH, (1, 37), generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, 37, HIDDEN).to(dtype)
    for table in cached:
        for layer_type in layer_types_of(table.inner):
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            want = table.inner(x, positions, **kwargs)
            got = table(x, positions, layer_type)
            for w, g in zip(want, got):
                assert g.dtype == w.dtype and g.shape == w.shape  # (Olmo2's stay float32)
                assert torch.equal(g, w)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_scaled_rotary_types_are_tabled_with_their_scaling(scaling):
    originals, swapped, cached = live_and_cached("LlamaForCausalLM", torch.float32,
                                                 rope_parameters={"rope_theta": 10000.0, **scaling})
    assert swapped == 1 and cached[0].inner.rope_type == scaling["rope_type"]
    positions = torch.arange(LENGTH)[None]
    cos, sin = cached[0](torch.empty(0), positions)
    want_cos, want_sin = cached[0].inner(torch.empty(0), positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    if scaling["rope_type"] == "yarn":  # its attention scaling is inside the table
        assert cached[0].inner.attention_scaling != 1.0 and cos[0, 0, 0].item() == pytest.approx(
            cached[0].inner.attention_scaling)


def test_dynamic_rotary_keeps_computing():
    """Dynamic NTK changes inv_freq once a sequence passes the original length: a table made at
    start would be wrong past it."""
    originals, swapped, cached = live_and_cached("LlamaForCausalLM", torch.float32,
                                                 rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic",
                                                                  "factor": 2.0})
    assert swapped == 0 and not cached
    assert type(originals[0]).__name__ == "LlamaRotaryEmbedding"


def test_a_module_whose_table_would_differ_keeps_computing():
    """The table is checked against the module before it replaces it."""
    model = tiny_model("LlamaForCausalLM")
    rotary = model.model.rotary_emb
    calls = {"n": 0}
    forward = rotary.forward

    def drifting(x, position_ids):  # a module whose result is not a function of the position alone
        calls["n"] += 1
        cos, sin = forward(x, position_ids)
        return cos + calls["n"], sin
    rotary.forward = drifting
    assert cache_rotary_embeddings(model, 64, torch.float32, torch.device("cpu")) == 0
    assert model.model.rotary_emb is rotary


def test_another_input_dtype_is_computed_by_the_module():
    _, _, cached = live_and_cached("LlamaForCausalLM", torch.bfloat16)
    cos, _ = cached[0](torch.empty(0, dtype=torch.float32), torch.tensor([[3, 5]]))
    want, _ = cached[0].inner(torch.empty(0, dtype=torch.float32), torch.tensor([[3, 5]]))
    assert cos.dtype == torch.float32 and torch.equal(cos, want)


def test_the_table_covers_exactly_the_positions_asked_for():
    _, _, cached = live_and_cached("LlamaForCausalLM", torch.float32)
    assert cached[0].cos_all.shape == (LENGTH, cached[0].cos_all.shape[1])
    with pytest.raises(IndexError):
        cached[0](torch.empty(0), torch.tensor([[LENGTH]]))


def test_head_dim_of_the_table_is_the_rotary_width():
    # Partial rotary (Phi, StableLM, GPT-NeoX): the table is as wide as the rotated part.
    _, _, cached = live_and_cached("PhiForCausalLM", torch.float32)
    assert cached[0].cos_all.shape[1] == (HIDDEN // HEADS) // 2
    _, _, cached = live_and_cached("LlamaForCausalLM", torch.float32)
    assert cached[0].cos_all.shape[1] == HIDDEN // HEADS
    assert HEAD_DIM == HIDDEN // HEADS


def test_an_engine_reads_its_rotary_embeddings_from_a_table(tiny_model_dirs, make_llm):
    """The runner swaps the module in (its fallbacks would only be logged), with room for the
    start-up steps that reach past max_model_len (the warm-up's block, a GPU's memory profile of a
    whole step budget)."""
    llm = make_llm(tiny_model_dirs["llama"], max_model_len=64, max_num_batched_tokens=256, block_size=16,
                   num_gpu_blocks=64)
    tables = [m for m in llm.engine.runner.model.modules() if isinstance(m, CachedRotaryEmbedding)]
    assert len(tables) == 1 and tables[0].length == 256
