"""The CPU serving backend equals the plain reference on random paged batches."""
import random

import pytest
import torch

from engine.attention import StepLayout, TorchAttentionBackend
from engine.attention import reference


def make_batch(q_lens, ctx_lens, block_size, num_blocks, hq, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)  # fragmented block tables
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    width = max(len(t) for t in tables)
    slots = []
    for t, q, c in zip(tables, q_lens, ctx_lens):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c - q, c)]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    layout = StepLayout(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=sum(1 for q in q_lens if q == 1), query_lens_list=list(q_lens), seq_lens_list=list(ctx_lens),
        block_size=block_size)
    total = sum(q_lens)
    return (torch.randn(total, hq, d, generator=gen), torch.randn(total, hkv, d, generator=gen),
            torch.randn(total, hkv, d, generator=gen), k_cache, v_cache, layout)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
def test_torch_backend_matches_reference(block_size, heads):
    # Decodes first (the runner's order), then a whole prefill and a chunk over cached context.
    q_lens, ctx_lens = [1, 1, 1, 12, 5], [7, 33, 16, 12, 29]
    query, key, value, k_cache, v_cache, layout = make_batch(q_lens, ctx_lens, block_size, 24, *heads, 16, seed=1)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, ref_k, ref_v, layout.slot_mapping)
    expected = reference.paged_attention(query, ref_k, ref_v, layout.block_tables, layout.query_start_loc,
                                         layout.seq_lens, 0.25)
    backend = TorchAttentionBackend()
    got = backend.forward(query, key, value, k_cache, v_cache, layout, backend.prepare(layout), 0.25)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
