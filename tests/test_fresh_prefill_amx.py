"""The AMX prefill attention kernel (csrc/fresh_prefill_amx_cpu.cpp) against float32 attention,
and the engine's bf16 greedy tokens with it against the paged kernel's. The kernel runs only on a
CPU with AMX tiles; elsewhere these tests skip (the backend then never routes to it: see
tests/test_cpu_attention.py)."""
from __future__ import annotations

import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.attention import cpu_kernels
from splitserve.engine.attention.backend import PLAIN
from splitserve.engine.attention.cpu_backend import CpuAttentionBackend
from splitserve.engine.attention.torch_backend import chunk_attention
from tests.test_engine_correctness import mixed_prompts

pytestmark = pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() and cpu_kernels.available()),
                                reason="needs a CPU with AMX tiles")


def reference(q, k, v, scale):
    return chunk_attention(q.float(), k.float(), v.float(), None, scale, PLAIN)


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 80), (12, 4, 32)])
@pytest.mark.parametrize("length", [1, 15, 32, 33, 64, 65, 250, 600])
def test_one_chunk_matches_float_attention(heads, length):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(length)
    q = torch.randn(length, hq, d, generator=g).bfloat16()
    k = torch.randn(length, hkv, d, generator=g).bfloat16()
    v = torch.randn(length, hkv, d, generator=g).bfloat16()
    out = torch.empty_like(q)
    torch.ops.splitserve_cpu.fresh_prefill_amx(out, q, k, v, [0, length], d ** -0.5)
    torch.testing.assert_close(out.float(), reference(q, k, v, d ** -0.5), atol=3e-2, rtol=2e-2)


def test_chunks_of_a_step_with_strided_keys_leave_other_rows_alone():
    """Several chunks after the step's decode rows; keys and values as the model hands them over
    (views of wider rows); the decode rows keep what the decode kernel wrote there."""
    g = torch.Generator().manual_seed(7)
    decodes, lens = 3, [40, 1, 129, 70]
    rows = decodes + sum(lens)
    q = torch.randn(rows, 9, 64, generator=g).bfloat16()
    kv = torch.randn(rows, 2, 3, 64, generator=g).bfloat16()  # k and v interleaved per row
    k, v = kv[:, 0], kv[:, 1]
    assert not k.is_contiguous()
    out = torch.full_like(q, 5.0)
    bounds = [decodes]
    for n in lens:
        bounds.append(bounds[-1] + n)
    torch.ops.splitserve_cpu.fresh_prefill_amx(out, q, k, v, bounds, 0.125)
    assert torch.all(out[:decodes] == 5.0)
    for a, b in zip(bounds, bounds[1:]):
        torch.testing.assert_close(out[a:b].float(), reference(q[a:b], k[a:b], v[a:b], 0.125), atol=3e-2, rtol=2e-2)


def test_the_backend_sends_only_what_the_kernel_takes():
    b = CpuAttentionBackend(fresh_prefill=True)
    q = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert b._amx_takes(q, q, q)
    assert not b._amx_takes(q.float(), q.float(), q.float())  # float32: SDPA
    odd = torch.zeros(8, 4, 24, dtype=torch.bfloat16)
    assert not b._amx_takes(odd, odd, odd)  # a head size the tiles do not take: SDPA
    strided = torch.zeros(8, 4, 128, dtype=torch.bfloat16)[..., ::2]
    assert not b._amx_takes(strided, strided, strided)


def test_in_an_engine_step_it_attends_as_float_attention_does(tiny_model_dirs, make_llm, step_mode):
    """A bf16 engine's fresh prefills go to the kernel with the model's own tensors (their strides,
    the step's chunk bounds), and each call's output is float32 attention over them. (Greedy tokens
    of a bf16 engine are no oracle here: the tiny model's choices flip with any change of rounding,
    the paged kernel's against SDPA's too.)"""
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, dtype="bfloat16", block_size=16, num_gpu_blocks=128, **step_mode)
    backend = llm.engine.runner.backend
    assert isinstance(backend, CpuAttentionBackend)
    backend.fresh_prefill = True
    kernel, checked = backend._fresh_prefill_amx, []

    def checking(out, q, k, v, bounds, scale):
        kernel(out, q, k, v, bounds, scale)
        for a, b in zip(bounds, bounds[1:]):
            torch.testing.assert_close(out[a:b].float(), reference(q[a:b], k[a:b], v[a:b], scale), atol=4e-2, rtol=2e-2)
            checked.append(b - a)
    backend._fresh_prefill_amx = checking
    prompts = mixed_prompts(6, seed=41, lo=33, hi=120)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [4] * len(prompts)
    assert sorted(checked) == sorted([len(p) for p in prompts] * llm.engine.runner.num_layers)
