"""A CPU step fed at the row count its oneDNN linears pad to (step_inputs.InputBuffers.pad_tokens):
the padding tokens write no KV, attend to nothing, hold zeros after attention, and the tokens
are still transformers' own."""
from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.cpu_linear import onednn_computes, padded_rows, step_padding
from tests.test_engine_correctness import GREEDY, assert_matches, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def record_steps(runner) -> list[tuple]:
    """(tokens in sequences, the step's inputs) of every step ``runner`` builds from now on; and,
    for each attention call, the rows it returned past those tokens."""
    seen, padding_rows = [], []
    build, attend = runner.inputs.build, runner.backend.forward

    def recording_build(*args, **kwargs):
        step = build(*args, **kwargs)
        # Copies: on the CPU the step's tensors are views of buffers the next step rewrites.
        fed = SimpleNamespace(input_ids=step.input_ids.clone(), positions=step.positions.clone(),
                              sample_index=step.sample_index.clone(),
                              slot_mappings=[layout.slot_mapping.clone() for layout in (step.layout, *step.group_layouts)])
        seen.append((step.layout.query_start_list[-1], fed))
        return step

    def recording_attend(query, key, value, k_cache, v_cache, layout, *rest, **kwargs):
        out = attend(query, key, value, k_cache, v_cache, layout, *rest, **kwargs)
        padding_rows.append(out[layout.query_start_list[-1]:].clone())
        return out

    runner.inputs.build, runner.backend.forward = recording_build, recording_attend
    return seen, padding_rows


@pytest.mark.parametrize("linear_backend", ["onednn", "onednn-matmul"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_steps_are_fed_padded_and_the_tokens_match_transformers(arch, linear_backend, tiny_model_dirs, make_llm,
                                                                 hf_reference, step_mode):
    model = tiny_model_dirs[arch]
    # Prompts of 30-60 tokens: the first step carries ~350 prompt tokens, which are not a padded count.
    prompts = mixed_prompts(8, seed=23, lo=30, hi=60)
    llm = make_llm(model, linear_backend=linear_backend, attention_backend="cpu", num_gpu_blocks=128, **step_mode)
    runner = llm.engine.runner
    seen, padding_rows = record_steps(runner)
    assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(model))

    padded = [(real, step) for real, step in seen if padded_rows(real) != real]
    assert padded, f"no step of a count that pads: {[real for real, _ in seen]}"
    for real, step in seen:
        fed = padded_rows(real)
        assert step.input_ids.shape[0] == step.positions.shape[0] == fed
        assert (step.input_ids[real:] == 0).all() and (step.positions[real:] == 0).all()
        for slots in step.slot_mappings:
            assert slots.shape[0] == fed
            assert (slots[real:] == -1).all()  # no KV written for them
            assert (slots[:real] >= 0).all()
        assert (step.sample_index < real).all()
    assert any(rows.numel() for rows in padding_rows)
    assert all((rows == 0).all() for rows in padding_rows)


@pytest.mark.skipif(not onednn_computes(torch.bfloat16), reason="this CPU's oneDNN has no native bf16")
@pytest.mark.parametrize("linear_backend", ["onednn", "onednn-matmul"])
def test_bf16_steps_give_the_same_tokens_padded_or_not(linear_backend, tiny_model_dirs, make_llm):
    """bf16, where a CPU with AMX tiles prefills fresh chunks with its own kernel: the padded step
    gives the tokens of the same step unpadded (each linear then pads its own input, to the same rows)."""
    prompts = mixed_prompts(8, seed=29, lo=30, hi=60)
    llm = make_llm(tiny_model_dirs["llama"], dtype="bfloat16", linear_backend=linear_backend, attention_backend="cpu",
                   num_gpu_blocks=128, enable_prefix_caching=False)
    runner = llm.engine.runner
    seen, padding_rows = record_steps(runner)
    padded = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert any(step.input_ids.shape[0] > real for real, step in seen)
    assert all((rows == 0).all() for rows in padding_rows)
    runner.inputs.pad_tokens = None
    seen.clear()
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == padded
    assert all(step.input_ids.shape[0] == real for real, step in seen)


def test_steps_are_not_padded_where_the_linears_do_not_pad(tiny_model_dirs, make_llm):
    """torch's linears run any row count as it is: padding would only add rows."""
    llm = make_llm(tiny_model_dirs["llama"], linear_backend="torch", attention_backend="cpu", num_gpu_blocks=64)
    seen, _ = record_steps(llm.engine.runner)
    llm.generate(mixed_prompts(4, seed=3, lo=30, hi=60), GREEDY)
    assert any(padded_rows(real) != real for real, _ in seen)
    assert all(step.input_ids.shape[0] == real for real, step in seen)


def test_only_steps_whose_linears_all_pad_are_padded():
    assert step_padding("onednn", "cpu", None, False, False) is padded_rows
    assert step_padding("onednn-matmul", "cpu", None, False, False) is padded_rows
    assert step_padding("torch", "cpu", None, False, False) is None  # linears that take any row count
    assert step_padding("onednn", "cpu", "int8", False, False) is None  # quantized linears do not pad
    assert step_padding("onednn", "cpu", None, True, False) is None  # LoRA's wrappers take a row per real token
    assert step_padding("onednn", "cpu", None, False, True) is None  # experts would compute the padding rows
    assert step_padding("onednn", "torch", None, False, False) is None  # a backend that attends for every row
