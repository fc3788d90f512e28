"""A CPU step fed at the row count its oneDNN linears pad to (step_inputs.InputBuffers.pad_tokens):
the padding tokens write no KV, attend to nothing, hold zeros after attention, and the tokens
are still transformers' own."""
import pytest
import torch

from splitserve.engine.cpu_linear import padded_rows, step_padding
from tests.test_engine_correctness import GREEDY, assert_matches, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def record_steps(runner) -> list[tuple]:
    """(tokens in sequences, the step's inputs) of every step ``runner`` builds from now on; and,
    for each attention call, the rows it returned past those tokens."""
    seen, padding_rows = [], []
    build, attend = runner.inputs.build, runner.backend.forward

    def recording_build(*args, **kwargs):
        step = build(*args, **kwargs)
        seen.append((step.layout.query_start_list[-1], step))
        return step

    def recording_attend(query, key, value, k_cache, v_cache, layout, *rest, **kwargs):
        out = attend(query, key, value, k_cache, v_cache, layout, *rest, **kwargs)
        padding_rows.append(out[layout.query_start_list[-1]:].clone())
        return out

    runner.inputs.build, runner.backend.forward = recording_build, recording_attend
    return seen, padding_rows


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_steps_are_fed_padded_and_the_tokens_match_transformers(arch, tiny_model_dirs, make_llm, hf_reference,
                                                                 step_mode):
    model = tiny_model_dirs[arch]
    # Prompts of 30-60 tokens: the first step carries ~350 prompt tokens, which are not a padded count.
    prompts = mixed_prompts(8, seed=23, lo=30, hi=60)
    llm = make_llm(model, linear_backend="onednn", attention_backend="cpu", num_gpu_blocks=128, **step_mode)
    runner = llm.engine.runner
    seen, padding_rows = record_steps(runner)
    assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(model))

    padded = [(real, step) for real, step in seen if padded_rows(real) != real]
    assert padded, f"no step of a count that pads: {[real for real, _ in seen]}"
    for real, step in seen:
        fed = padded_rows(real)
        assert step.input_ids.shape[0] == step.positions.shape[0] == step.layout.slot_mapping.shape[0] == fed
        assert (step.input_ids[real:] == 0).all() and (step.positions[real:] == 0).all()
        for layout in (step.layout, *step.group_layouts):
            assert (layout.slot_mapping[real:] == -1).all()  # no KV written for them
            assert (layout.slot_mapping[:real] >= 0).all()
        assert (step.sample_index < real).all()
    assert any(rows.numel() for rows in padding_rows)
    assert all((rows == 0).all() for rows in padding_rows)


def test_steps_are_not_padded_where_the_linears_do_not_pad(tiny_model_dirs, make_llm):
    """torch's linears run any row count as it is: padding would only add rows."""
    llm = make_llm(tiny_model_dirs["llama"], linear_backend="torch", attention_backend="cpu", num_gpu_blocks=64)
    seen, _ = record_steps(llm.engine.runner)
    llm.generate(mixed_prompts(4, seed=3, lo=30, hi=60), GREEDY)
    assert any(padded_rows(real) != real for real, _ in seen)
    assert all(step.input_ids.shape[0] == real for real, step in seen)


def test_only_steps_whose_linears_all_pad_are_padded():
    assert step_padding("onednn", None, False, "cpu") is padded_rows
    assert step_padding("torch", None, False, "cpu") is None  # linears that take any row count
    assert step_padding("onednn", "int8", False, "cpu") is None  # quantized linears do not pad
    assert step_padding("onednn", None, True, "cpu") is None  # LoRA's wrappers take a row per real token
    assert step_padding("onednn", None, False, "torch") is None  # a backend that does not leave padding out
