"""Paged attention kernels: Triton vs the torch reference, and the reference vs dense SDPA.

Without a GPU the Triton kernels run through the Triton interpreter on CPU tensors
(TRITON_INTERPRET=1, set by conftest.py before triton is imported unless the environment says
otherwise; here too, for a run outside pytest's conftest).  On a machine with CUDA the kernels are compiled and the same cases run on the GPU
under ``@pytest.mark.gpu`` (the CPU cases then skip: compiled Triton cannot take CPU tensors);
``TRITON_INTERPRET=1`` exported there interprets them instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from splitserve.engine.attention import reference  # noqa: E402
from splitserve.engine.attention import triton_kernels, triton_decode  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(not triton_kernels.TRITON_AVAILABLE, reason="triton is not installed")
cpu_interpret = pytest.mark.skipif(
    not INTERPRET, reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
)

# ---------------------------------------------------------------------------------------------
# Scenario construction
# ---------------------------------------------------------------------------------------------

# Each scenario is a list of (cached_tokens, new_tokens) per sequence; seq_len = cached + new.
SCENARIOS = {
    "decode": [(4, 1), (16, 1), (33, 1)],
    "prefill": [(0, 7), (0, 19), (0, 3)],
    "chunked": [(16, 8), (5, 11)],  # prefix-cache hit / later chunk of a chunked prefill
    "mixed": [(9, 1), (0, 13), (20, 6), (30, 1)],  # decodes + prefill + chunked prefill
    "empty_seq": [(7, 1), (3, 0), (12, 1)],  # a sequence with no new tokens this step
}


class Batch:
    """A paged cache holding the context of a few sequences, plus their new-token queries."""

    def __init__(self, scenario, block_size, num_q_heads, num_kv_heads, head_dim, dtype, device,
                 fragmented, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.block_size = block_size
        self.seq_lens_list = [c + n for c, n in scenario]
        self.q_lens = [n for _, n in scenario]
        num_seqs = len(scenario)
        blocks_per_seq = [math.ceil(s / block_size) for s in self.seq_lens_list]
        num_used = sum(blocks_per_seq)
        num_blocks = num_used + 3  # spare blocks that no sequence owns, and a poison block
        physical = list(range(num_blocks - 1))
        if fragmented:
            rng.shuffle(physical)
        self.poison_block = num_blocks - 1

        # Unused slots (including the tail of each sequence's last block) hold NaN, so any read
        # outside a sequence's context poisons the output.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)

        max_blocks = max(blocks_per_seq) + 1  # at least one padding column for everyone
        self.block_tables = torch.full((num_seqs, max_blocks), self.poison_block, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        cursor = 0
        for b, seq_len in enumerate(self.seq_lens_list):
            ids = physical[cursor:cursor + blocks_per_seq[b]]
            cursor += blocks_per_seq[b]
            self.block_tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.dense_k.append(k)
            self.dense_v.append(v)
            slots = self.slots(b, range(seq_len))
            reference.write_kv(k, v, self.k_cache, self.v_cache, slots)

        total_q = sum(self.q_lens)
        self.query = torch.randn(total_q, num_q_heads, head_dim, generator=gen).to(dtype)
        qsl = [0]
        for n in self.q_lens:
            qsl.append(qsl[-1] + n)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32)
        self.scale = head_dim ** -0.5
        self.to(device)

    def slots(self, b, positions):
        table = self.block_tables[b].tolist()
        return torch.tensor(
            [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions],
            dtype=torch.int64,
        )

    def to(self, device):
        for name in ("k_cache", "v_cache", "block_tables", "query", "query_start_loc", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def attention_args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale)


def dense_causal_sdpa(batch):
    """Attention on the un-paged K/V with torch's SDPA, one sequence at a time."""
    outs = []
    num_q_heads = batch.query.shape[1]
    qsl = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens_list):
        q_len = batch.q_lens[b]
        if q_len == 0:
            continue
        group = num_q_heads // batch.dense_k[b].shape[1]
        q = batch.query[qsl[b]:qsl[b + 1]].float().cpu().transpose(0, 1)  # [Hq, q_len, D]
        k = batch.dense_k[b].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = batch.dense_v[b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        # New token i sits at position seq_len - q_len + i and sees keys 0..that position.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------------------------------
# Reference vs dense SDPA (checks the reference itself; no triton needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("block_size,heads", [(8, (4, 4)), (16, (6, 2)), (32, (9, 3))])
def test_reference_matches_dense_sdpa(scenario, fragmented, block_size, heads):
    batch = Batch(SCENARIOS[scenario], block_size, heads[0], heads[1], 64, torch.float32, "cpu",
                  fragmented)
    out = reference.paged_attention(*batch.attention_args())
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, dense_causal_sdpa(batch), atol=1e-5, rtol=1e-5)


def test_reference_write_kv_skips_negative_slots():
    cache_shape = (3, 4, 2, 8)
    k_cache = torch.zeros(cache_shape)
    v_cache = torch.zeros(cache_shape)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    reference.write_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 11]))
    torch.testing.assert_close(k_cache[1, 1], key[0])
    torch.testing.assert_close(v_cache[2, 3], value[2])
    written = (k_cache != 0).any(dim=-1).any(dim=-1).flatten().nonzero().flatten().tolist()
    assert written == [5, 11]  # slot -1 was skipped


# ---------------------------------------------------------------------------------------------
# Triton vs reference
# ---------------------------------------------------------------------------------------------

# (scenario, fragmented, block_size, (num_q_heads, num_kv_heads), head_dim, dtype)
ATTENTION_CASES = [
    ("decode", False, 16, (4, 4), 64, torch.float32),
    ("decode", True, 8, (6, 2), 64, torch.float32),
    ("decode", True, 32, (9, 3), 64, torch.float32),
    ("prefill", False, 8, (9, 3), 64, torch.float32),
    ("prefill", True, 32, (4, 4), 64, torch.float32),
    ("prefill", True, 16, (6, 2), 64, torch.float32),
    ("chunked", True, 8, (4, 4), 64, torch.float32),
    ("chunked", False, 16, (9, 3), 64, torch.float32),
    ("chunked", True, 32, (6, 2), 64, torch.float32),
    ("mixed", True, 16, (4, 4), 64, torch.float32),
    ("mixed", False, 32, (6, 2), 64, torch.float32),
    ("mixed", True, 8, (9, 3), 64, torch.float32),
    ("empty_seq", True, 16, (6, 2), 64, torch.float32),
    ("mixed", True, 16, (6, 2), 128, torch.float32),
    ("decode", True, 16, (6, 2), 128, torch.float32),
    ("mixed", True, 16, (9, 3), 80, torch.float32),  # head_dim not a power of two
    ("mixed", True, 16, (6, 2), 64, torch.bfloat16),
    ("decode", True, 8, (9, 3), 64, torch.bfloat16),
]


def _case_id(case):
    scenario, fragmented, block_size, heads, head_dim, dtype = case
    layout = "frag" if fragmented else "contig"
    return f"{scenario}-{layout}-bs{block_size}-h{heads[0]}x{heads[1]}-d{head_dim}-{str(dtype)[6:]}"


def _tolerance(dtype):
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=2e-2, rtol=2e-2)


def _check_attention(case, device):
    scenario, fragmented, block_size, (hq, hkv), head_dim, dtype = case
    batch = Batch(SCENARIOS[scenario], block_size, hq, hkv, head_dim, dtype, device, fragmented)
    expected = reference.paged_attention(*batch.attention_args())
    out = triton_kernels.paged_attention(*batch.attention_args())
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.device == expected.device
    assert not torch.isnan(out.float()).any(), "kernel read a slot outside some sequence's context"
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


def _check_write_kv(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, head_dim = 5, 8, 2, 64
    num_tokens = 12
    shape = (num_blocks, block_size, hkv, head_dim)
    init_k = torch.randn(shape, generator=gen).to(dtype)
    init_v = torch.randn(shape, generator=gen).to(dtype)
    key = torch.randn(num_tokens, hkv, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, hkv, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 11]] = -1  # padding tokens
    k_ref, v_ref = init_k.clone(), init_v.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)

    k_tri, v_tri = init_k.clone().to(device), init_v.clone().to(device)
    triton_kernels.write_kv(key.to(device), value.to(device), k_tri, v_tri, slots.to(device))
    torch.testing.assert_close(k_tri.cpu(), k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_tri.cpu(), v_ref, atol=0, rtol=0)
    # Only the non-padding slots changed.
    changed = (k_tri.cpu() != init_k).any(dim=-1).any(dim=-1).flatten().nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(s for s in slots.tolist() if s >= 0)


def _check_decode_loop(device):
    """write_kv + paged_attention end to end: a prompt, then a few decode steps, vs dense SDPA."""
    gen = torch.Generator().manual_seed(2)
    block_size, hq, hkv, head_dim = 8, 6, 2, 64
    prompt_lens = [11, 5]
    steps = 3
    num_blocks = 9
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = torch.zeros(shape, device=device)
    v_cache = torch.zeros(shape, device=device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.tensor([perm[0:3], perm[3:6]], dtype=torch.int32, device=device)
    total = [p + steps for p in prompt_lens]
    keys = [torch.randn(n, hkv, head_dim, generator=gen) for n in total]
    values = [torch.randn(n, hkv, head_dim, generator=gen) for n in total]
    queries = [torch.randn(n, hq, head_dim, generator=gen) for n in total]
    scale = head_dim ** -0.5

    def slot(b, p):
        return int(block_tables[b, p // block_size]) * block_size + p % block_size

    def dense(b, lo, hi):
        q = queries[b][lo:hi].transpose(0, 1)
        k = keys[b][:hi].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = values[b][:hi].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.ones(hi - lo, hi, dtype=torch.bool).tril(diagonal=lo)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)

    # Step 0: prefill both prompts in one batch; later steps: one new token each.
    ranges = [[(0, p) for p in prompt_lens]] + [[(p + s, p + s + 1) for p in prompt_lens] for s in range(steps)]
    for step in ranges:
        q = torch.cat([queries[b][lo:hi] for b, (lo, hi) in enumerate(step)]).to(device)
        k = torch.cat([keys[b][lo:hi] for b, (lo, hi) in enumerate(step)]).to(device)
        v = torch.cat([values[b][lo:hi] for b, (lo, hi) in enumerate(step)]).to(device)
        slots = torch.tensor([slot(b, p) for b, (lo, hi) in enumerate(step) for p in range(lo, hi)],
                             dtype=torch.int64, device=device)
        triton_kernels.write_kv(k, v, k_cache, v_cache, slots)
        qsl = torch.tensor([0, step[0][1] - step[0][0], sum(hi - lo for lo, hi in step)],
                           dtype=torch.int32, device=device)
        seq_lens = torch.tensor([hi for _, hi in step], dtype=torch.int32, device=device)
        out = triton_kernels.paged_attention(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale)
        expected = torch.cat([dense(b, lo, hi) for b, (lo, hi) in enumerate(step)])
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@needs_triton
@cpu_interpret
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_paged_attention_triton_cpu(case):
    _check_attention(case, "cpu")


@needs_triton
@cpu_interpret
def test_write_kv_triton_cpu():
    _check_write_kv("cpu")


@needs_triton
@cpu_interpret
def test_write_kv_triton_cpu_bf16():
    _check_write_kv("cpu", torch.bfloat16)


@needs_triton
@cpu_interpret
def test_decode_loop_triton_cpu():
    _check_decode_loop("cpu")


# Long decodes, each context cut into 64-token partitions; one sequence is shorter than the
# later partitions, which then hold nothing.
SPLIT_KV_CASES = [
    ([(150, 1), (70, 1), (201, 1)], 16, (9, 3), 64, torch.float32, 4),
    ([(150, 1), (5, 1)], 8, (4, 4), 64, torch.float32, 3),
    ([(130, 1), (64, 1)], 16, (6, 2), 80, torch.bfloat16, 3),
]


def _check_split_kv(case, device):
    scenario, block_size, (hq, hkv), head_dim, dtype, splits = case
    batch = Batch(scenario, block_size, hq, hkv, head_dim, dtype, device, fragmented=True)
    expected = reference.paged_attention(*batch.attention_args())
    out = triton_decode.paged_decode(*batch.attention_args(), num_splits=splits, split_len=64)
    assert not torch.isnan(out.float()).any(), "kernel read a slot outside some sequence's context"
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


def test_num_splits_fill_the_device_only_when_the_batch_cannot():
    assert triton_decode.num_splits_for(64, 8, 8192, target_programs=264) == 1
    assert triton_decode.num_splits_for(2, 8, 8192, target_programs=264) == 16  # capped by the context
    assert triton_decode.num_splits_for(2, 8, 100, target_programs=264) == 1
    assert triton_decode.num_splits_for(1, 4, 4096, target_programs=16, split_len=512) == 4


@needs_triton
@cpu_interpret
@pytest.mark.parametrize("case", SPLIT_KV_CASES, ids=lambda c: f"splits{c[-1]}-{str(c[4])[6:]}")
def test_split_kv_decode_triton_cpu(case):
    _check_split_kv(case, "cpu")


@needs_triton
@pytest.mark.parametrize("case", SPLIT_KV_CASES, ids=lambda c: f"splits{c[-1]}-{str(c[4])[6:]}")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_split_kv_decode_triton_cuda(case):
    _check_split_kv(case, "cuda")


@needs_triton
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_paged_attention_triton_cuda(case):
    _check_attention(case, "cuda")


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_write_kv_triton_cuda():
    _check_write_kv("cuda")
    _check_write_kv("cuda", torch.bfloat16)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_decode_loop_triton_cuda():
    _check_decode_loop("cuda")
