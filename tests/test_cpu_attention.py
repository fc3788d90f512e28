"""The CPU decode kernel (splitserve/engine/attention/csrc) and the CPU backend against the plain reference.

Slots outside every sequence's context hold NaN (the ``Batch`` helper of the Triton tests), so a
kernel that reads past a context, or a page tail, poisons its output.
"""
import random

import pytest
import torch

from splitserve.engine.attention import StepLayout, cpu_kernels, reference
from splitserve.engine.attention.cpu_backend import CpuAttentionBackend
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from tests.test_attention_kernels import SCENARIOS, Batch, dense_causal_sdpa



KERNELS_LOADED = cpu_kernels.available()  # builds (once) and loads torch.ops.splitserve_cpu


def test_kernels_build_here():
    # gcc and ninja are part of the set-up: a build failure is a failure, not a skip.
    assert KERNELS_LOADED, cpu_kernels.load_error()

LONG_DECODE = [(150, 1), (70, 1), (201, 1), (1, 1)]


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


def decode(batch: Batch, head_major: bool = False) -> torch.Tensor:
    k, v = batch.k_cache, batch.v_cache
    if head_major:  # the same values in [blocks, heads, block_size, D] memory, viewed as the kernel's order
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty_like(batch.query)
    torch.ops.splitserve_cpu.paged_decode(out, batch.query, k, v, batch.block_tables, batch.seq_lens, batch.scale)
    return out


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
# GQA groups 1, 3, 8 (two walks of 4), 5 (4 + 1) and 7 (4 + 3): the kernel walks a KV head's
# pages for up to four query heads at a time.
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1), (10, 2), (14, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_matches_reference(head_dim, heads, block_size):
    batch = Batch(LONG_DECODE, block_size, *heads, head_dim, torch.float32, "cpu", fragmented=True)
    expected = reference.paged_attention(*batch.attention_args())
    out = decode(batch)
    assert not torch.isnan(out).any(), "read a slot outside a sequence's context"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_bf16_decode_kernel_is_built_where_the_cpu_has_avx512_bf16():
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert torch.ops.splitserve_cpu.decode_uses_bf16_dot() == ("avx512_bf16" in flags and "avx512f" in flags)


# bf16 pages with bf16 queries take a kernel of their own where the CPU has AVX512-BF16 (head
# sizes that are multiples of 32; 16 and 80 keep the generic one): scores 16 tokens at a time,
# so block sizes below, at and above 16, and page tails, are each covered.
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 16), (torch.bfloat16, 64), (torch.bfloat16, 80),
                                            (torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (14, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_decode_kernel_half_precision_pages(dtype, head_dim, heads, block_size, head_major):
    batch = Batch(LONG_DECODE, block_size, *heads, head_dim, dtype, "cpu", fragmented=True)
    expected = reference.paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(),
                                         *batch.attention_args()[3:])
    out = decode(batch, head_major)
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "read a slot outside a sequence's context"
    # Half-precision output: one rounding of a value below ~1 (2^-9 for bf16) on top of float32 sums.
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_decode_kernel_reads_head_major_pages_in_place():
    batch = Batch(LONG_DECODE, 16, 6, 2, 64, torch.float32, "cpu", fragmented=True)
    torch.testing.assert_close(decode(batch, head_major=True), decode(batch), atol=0, rtol=0)


def test_decode_kernel_refuses_what_it_cannot_do():
    batch = Batch(SCENARIOS["decode"], 16, 4, 4, 64, torch.float32, "cpu", fragmented=False)
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="head_dim"):
        q = torch.zeros(3, 4, 24)
        torch.ops.splitserve_cpu.paged_decode(torch.empty_like(q), q, torch.zeros(4, 16, 4, 24),
                                              torch.zeros(4, 16, 4, 24), batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.splitserve_cpu.paged_decode(out, batch.query, batch.k_cache, batch.v_cache,
                                              batch.block_tables.long(), batch.seq_lens, 1.0)


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchAttentionBackend])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_backend_step_matches_reference(backend, block_size, heads, head_major):
    # Decodes first (the runner's order), then a whole prefill and a chunk over cached context.
    q_lens, ctx_lens = [1, 1, 1, 12, 5], [7, 33, 16, 12, 29]
    query, key, value, k_cache, v_cache, layout = make_batch(q_lens, ctx_lens, block_size, 24, *heads, 16, seed=1)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    if head_major:  # the runner's CPU pool: [blocks, heads, block_size, D] memory, written in place
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    reference.write_kv(key, value, ref_k, ref_v, layout.slot_mapping)
    expected = reference.paged_attention(query, ref_k, ref_v, layout.block_tables, layout.query_start_loc,
                                         layout.seq_lens, 0.25)
    b = backend()
    got = b.forward(query, key, value, k_cache, v_cache, layout, b.prepare(layout), 0.25)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prefills_off_the_paged_kernel_match_reference(dtype):
    """With every prefill chunk fresh, the step's prefills go to the AMX kernel (bf16 on a CPU with
    tiles) or torch's SDPA and give the kernel's attention; a chunk over cached context keeps the
    step on the paged kernel, whichever the setting."""
    b = CpuAttentionBackend(fresh_prefill=True)
    calls = []
    kernel = b._paged_prefill
    b._paged_prefill = lambda *args: (calls.append(1), kernel(*args))
    for q_lens, ctx_lens, kernel_calls in (([1, 1, 40, 17], [9, 30, 40, 17], 0), ([1, 40, 5], [9, 40, 29], 1)):
        query, key, value, k_cache, v_cache, layout = make_batch(q_lens, ctx_lens, 16, 24, 9, 3, 64, seed=2)
        query, key, value, k_cache, v_cache = (t.to(dtype) for t in (query, key, value, k_cache, v_cache))
        ref_k, ref_v = k_cache.float(), v_cache.float()
        reference.write_kv(key.float(), value.float(), ref_k, ref_v, layout.slot_mapping)
        expected = reference.paged_attention(query.float(), ref_k, ref_v, layout.block_tables,
                                             layout.query_start_loc, layout.seq_lens, 0.125)
        calls.clear()
        got = b.forward(query, key, value, k_cache, v_cache, layout, b.prepare(layout), 0.125)
        assert len(calls) == kernel_calls
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_fresh_prefills_leave_the_paged_kernel_only_where_and_when_it_is_slower(monkeypatch):
    from splitserve.engine.attention import cpu_backend
    b = CpuAttentionBackend()
    plan = lambda q_lens, ctx_lens: b.prepare(make_batch(q_lens, ctx_lens, 16, 40, 9, 3, 64, seed=0)[-1])  # noqa: E731
    long_fresh = plan([1, cpu_backend.AMX_MIN_TOKENS], [20, cpu_backend.AMX_MIN_TOKENS])
    short_fresh = plan([1, cpu_backend.AMX_MIN_TOKENS - 1], [20, cpu_backend.AMX_MIN_TOKENS - 1])
    long_with_prefix = plan([cpu_backend.AMX_MIN_TOKENS, 3], [cpu_backend.AMX_MIN_TOKENS, 19])
    sdpa_long = plan([1, cpu_backend.SDPA_MIN_TOKENS], [20, cpu_backend.SDPA_MIN_TOKENS])
    monkeypatch.setattr(cpu_backend, "amx_prefill_wanted", lambda dtype: dtype == torch.bfloat16)  # an AMX CPU
    assert b._fresh_route(torch.bfloat16, long_fresh, amx=True)
    assert not b._fresh_route(torch.float32, long_fresh, amx=True)
    assert not b._fresh_route(torch.bfloat16, short_fresh, amx=True)
    assert not b._fresh_route(torch.bfloat16, long_with_prefix, amx=True)
    # A layer the AMX kernel cannot take goes to SDPA only where SDPA beats the paged kernel.
    assert not b._fresh_route(torch.bfloat16, long_fresh, amx=False)
    assert b._fresh_route(torch.bfloat16, sdpa_long, amx=False)
    monkeypatch.setattr(cpu_backend, "amx_prefill_wanted", lambda dtype: False)  # no AMX
    assert not b._fresh_route(torch.bfloat16, long_fresh, amx=True)
    assert not CpuAttentionBackend(fresh_prefill=False)._fresh_route(torch.bfloat16, long_fresh, amx=True)


def test_the_amx_route_is_wanted_for_bf16_where_the_cpu_has_amx_tiles():
    from splitserve.engine.attention.cpu_backend import amx_prefill_wanted
    with open("/proc/cpuinfo") as cpuinfo:  # the kernel lists amx_* only where it enables the tiles
        flags = cpuinfo.read()
    assert amx_prefill_wanted(torch.bfloat16) == (" amx_tile" in flags and " amx_bf16" in flags)
    assert not amx_prefill_wanted(torch.float32)


def test_layout_fills_query_starts():
    layout = StepLayout(slot_mapping=torch.zeros(4, dtype=torch.int64), query_start_loc=torch.tensor([0, 1, 4]),
                        seq_lens=torch.tensor([5, 3]), block_tables=torch.zeros(2, 1, dtype=torch.int32),
                        num_decodes=1, query_lens_list=[1, 3], seq_lens_list=[5, 3], block_size=8)
    assert layout.query_start_list == [0, 1, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_and_decode_skips_padding_slots_and_leaves_prefill_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(6, 8, 2, 16, dtype=dtype)
    v_cache = torch.zeros(6, 8, 2, 16, dtype=dtype)
    key, value = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    query = torch.randn(3, 4, 16, generator=gen)
    slots = torch.tensor([9, -1, 17])  # the second token is padding (a CUDA-graph row, say)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, ref_k, ref_v, slots)
    out = torch.full_like(query, 7.0)
    tables = torch.tensor([[1, 2], [0, 0], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([2, 0, 2], dtype=torch.int32)
    torch.ops.splitserve_cpu.write_and_decode(out, query, key, value, k_cache, v_cache, slots, tables, lens, 1, 0.25)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    expected = reference.paged_attention(query[:1], ref_k.float(), ref_v.float(), tables[:1],
                                         torch.tensor([0, 1], dtype=torch.int32), lens[:1], 0.25)
    torch.testing.assert_close(out[:1], expected, atol=1e-5, rtol=1e-5)
    assert (out[1:] == 7.0).all()  # rows past num_decodes are the caller's


@pytest.mark.parametrize("scenario", ["prefill", "chunked", "mixed", "empty_seq"])
@pytest.mark.parametrize("block_size", [8, 16, 32])  # slices of 16 keys span pages, fill one, or half of one
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((9, 3), 64), ((16, 1), 32), ((12, 4), 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_dense_attention(scenario, block_size, heads, head_dim, dtype):
    """Every chunk after the decodes attends causally over its whole context, cached prefix
    included, read from fragmented pages whose unused slots hold NaN; decode rows are left alone."""
    batch = Batch(SCENARIOS[scenario], block_size, *heads, head_dim, dtype, "cpu", fragmented=True, seed=5)
    # The leading one-token sequences are the decodes; every sequence after them is a chunk (a
    # later one-token sequence too: a chunk of one attends as a decode does).
    num_decodes = next((i for i, n in enumerate(batch.q_lens) if n != 1), len(batch.q_lens))
    out = torch.full_like(batch.query, 7.0)
    torch.ops.splitserve_cpu.paged_prefill(out, batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                           batch.query_start_loc, batch.seq_lens, num_decodes, batch.scale)
    expected = dense_causal_sdpa(batch)
    first_prefill_row = int(batch.query_start_loc[num_decodes])
    assert (out[:first_prefill_row] == 7.0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[first_prefill_row:].float(), expected[first_prefill_row:], rtol=tol, atol=tol)


def test_prefill_kernel_refuses_bad_input():
    batch = Batch(SCENARIOS["prefill"], 16, 4, 4, 16, torch.float32, "cpu", fragmented=False)
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.splitserve_cpu.paged_prefill(out[..., :8], batch.query[..., :8], batch.k_cache[..., :8],
                                               batch.v_cache[..., :8], batch.block_tables, batch.query_start_loc,
                                               batch.seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.splitserve_cpu.paged_prefill(out, batch.query, batch.k_cache, batch.v_cache,
                                               batch.block_tables.long(), batch.query_start_loc, batch.seq_lens, 0, 1.0)
    short = batch.seq_lens.clone()
    short[0] = 1  # fewer context tokens than the chunk's own
    with pytest.raises(RuntimeError, match="bad rows or length"):
        torch.ops.splitserve_cpu.paged_prefill(out, batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.query_start_loc, short, 0, 1.0)


def test_each_checkout_builds_the_kernels_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """torch's build file names the sources by path: two checkouts sharing a build directory
    rebuilt it in turn (a fresh clone's test run and a worktree's server waited ~80 s each time)."""
    import shutil

    key = cpu_kernels._build_key()
    assert cpu_kernels._build_key() == key  # the same checkout: the same directory, built once
    copies = []
    for source in cpu_kernels._SOURCES:
        copies.append(tmp_path / source.name)
        shutil.copyfile(source, copies[-1])
    monkeypatch.setattr(cpu_kernels, "_SOURCES", copies)
    assert cpu_kernels._build_key() != key  # the same sources elsewhere: another directory


def test_a_build_lock_left_by_a_killed_process_does_not_hold_up_the_next_start(tmp_path):
    """torch's build lock is a file it waits on while it exists, taken at every load: a process
    killed mid-build (a worker stopped during its first start) left it, and every later start
    waited forever. The build here is of a plain C++ function, in a cache of the test's own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    source = tmp_path / "one_function.cpp"
    source.write_text("extern \"C\" int splitserve_test_one() { return 1; }\n")
    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path / "cache")}
    build = ("import sys; from pathlib import Path; from splitserve.engine.attention import cpu_kernels; "
             f"sources = [Path({str(source)!r})]; d = cpu_kernels._build_dir(sources, []); "
             "d.mkdir(parents=True); (d / 'lock').touch(); "  # what the killed build left
             "cpu_kernels._build('left_lock', sources, []); print(d)")
    done = subprocess.run([sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    build_dir = Path(done.stdout.strip().splitlines()[-1])
    assert not (build_dir / "lock").exists() and list(build_dir.glob("left_lock_*.so"))
