"""splitserve.cli.sizing: tensor parallelism in the KV and weight arithmetic.

The numbers are worked out by hand in the comments (Llama-3 shapes from their config.json), not
recomputed with the functions under test. The docs' examples are checked against the CLI's output
by tests/service/test_compose.py."""
from __future__ import annotations

import pytest

from splitserve.cli import sizing
from splitserve.cli.sizing import KVShape, kv_bytes_per_token, pages_for, tp_refusal, weight_bytes_per_gpu, weight_params

SMOLLM2 = KVShape.from_config("smollm2", {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True})
LLAMA3_8B = KVShape("llama-3-8b", 32, 8, 128, heads=32, hidden_size=4096, intermediate_size=14336,
                    vocab_size=128256)
LLAMA3_70B = KVShape("llama-3-70b", 80, 8, 128, heads=64, hidden_size=8192, intermediate_size=28672,
                     vocab_size=128256)


def test_weight_params_match_the_published_counts():
    # SmolLM2: per layer q+o 2*576*9*64 = 663,552, k+v 2*576*3*64 = 221,184, MLP 3*576*1536 =
    # 2,654,208 -> 3,538,944 x 30 = 106,168,320 split; embeddings tied 49,152*576 = 28,311,552 and
    # 61 norms of 576 = 35,136 -> 28,346,688 whole; 134,515,008 in all (SmolLM2-"135M").
    assert weight_params(SMOLLM2) == (106_168_320, 28_346_688)
    # Llama-3-8B: (33,554,432 + 8,388,608 + 176,160,768) x 32 = 6,979,321,856 split; untied
    # embeddings 2 x 128,256 x 4,096 = 1,050,673,152 plus 65 norms of 4,096 -> 8,030,261,248 ("8B").
    assert weight_params(LLAMA3_8B) == (6_979_321_856, 1_050_939_392)
    assert sum(weight_params(LLAMA3_70B)) == 70_553_706_496  # "70B"
    assert weight_params(KVShape("kv only", 32, 8, 128)) is None


def test_weights_per_gpu_split_the_projections_and_keep_embeddings_whole():
    # bf16, TP=2: (6,979,321,856 / 2 + 1,050,939,392) x 2 B = 9,081,200,640 B (8.46 GiB), not 16.06 / 2 GB.
    assert weight_bytes_per_gpu(LLAMA3_8B, "bfloat16", 1) == 16_060_522_496
    assert weight_bytes_per_gpu(LLAMA3_8B, "bfloat16", 2) == 9_081_200_640
    # 70B, TP=4: (68,451,041,280 / 4 + 2,102,665,216) x 2 = 38,430,851,072 B (35.8 GiB per GPU).
    assert weight_bytes_per_gpu(LLAMA3_70B, "bfloat16", 4) == 38_430_851_072


def test_kv_per_gpu_and_pages_with_tensor_parallelism():
    # A token of Llama-3-8B: 2 x 32 x 8 x 128 x 2 = 131,072 B; each of 2 ranks holds 4 KV heads: 65,536 B.
    assert kv_bytes_per_token(LLAMA3_8B, "bfloat16") == 131_072
    assert kv_bytes_per_token(LLAMA3_8B, "bfloat16", tensor_parallel_size=2) == 65_536
    # int8 pages: 2 x 32 x 4 x (128 + 4) x 1 = 33,792 B per token per GPU at TP=2.
    assert kv_bytes_per_token(LLAMA3_8B, "bfloat16", "int8", tensor_parallel_size=2) == 33_792
    # 56 GiB per GPU: 56 x 2^30 / (131,072 x 16) = 28,672 pages alone, 57,344 as each of 2 ranks
    # (each page costs a GPU half as much), 114,688 on 4.
    assert pages_for(56, LLAMA3_8B, "bfloat16", 16) == 28_672
    assert pages_for(56, LLAMA3_8B, "bfloat16", 16, tensor_parallel_size=2) == 57_344
    assert pages_for(56, LLAMA3_8B, "bfloat16", 16, tensor_parallel_size=4) == 114_688


def test_heads_must_divide_by_the_tensor_parallel_size():
    assert tp_refusal(LLAMA3_8B, 1) is None and tp_refusal(LLAMA3_8B, 8) is None
    assert "8 KV heads" in tp_refusal(LLAMA3_8B, 16)  # 32 query heads would split, 8 KV heads not
    assert "9 attention heads" in tp_refusal(SMOLLM2, 2)  # the default model: 9 / 3 heads
    assert tp_refusal(SMOLLM2, 3) is None
    assert "3 KV heads" in tp_refusal(SMOLLM2, 9)
    # Without the query head count only the KV heads can be checked.
    assert tp_refusal(KVShape("kv only", 32, 8, 128), 4) is None


def test_llama_3_70b_on_eight_80_gib_gpus_is_one_tp4_pair():
    options = sizing.layouts(LLAMA3_70B, "bfloat16", "auto", 16, gpus=8, gpu_memory_gib=80, overhead_gib=8)
    assert [o.tensor_parallel_size for o in options] == [1, 2, 4]  # 3 does not divide 64 heads; 8 leaves no pair
    tp1, tp2, tp4 = options
    assert tp1.pages == 0 and tp1.kv_gib < 0  # 131.4 GiB of weights on one GPU
    # TP=2: 80 - 8 - 67.67 (72,656,371,712 B) = 4.33 -> 4.3 GiB; pages of 16 x 163,840 B = 2,621,440 B:
    # floor(4.3 x 2^30 / 2,621,440) = 1,761, 3 sequences of 8,192 tokens (512 pages each); 2 pairs.
    assert (tp2.pairs, tp2.kv_gib, tp2.pages, tp2.sequences(8192, 16)) == (2, 4.3, 1_761, 3)
    # TP=4: 80 - 8 - 35.79 = 36.2 GiB; pages of 1,310,720 B: 29,655 -> 57 sequences; 1 pair.
    assert (tp4.pairs, tp4.kv_gib, tp4.pages, tp4.sequences(8192, 16)) == (1, 36.2, 29_655, 57)
    assert sizing.suggest(options, 8192, 16, min_sequences=8) is tp4
    assert sizing.suggest(options, 8192, 16, min_sequences=58) is None


def test_llama_3_8b_on_eight_24_gib_gpus_is_two_tp2_pairs(capsys):
    # TP=1: 24 - 4 - 14.96 = 5.0 GiB of 2 MiB pages (16 x 131,072 B) = 2,560 -> 5 sequences of 512 pages, 4 pairs.
    # TP=2: 24 - 4 - 8.46 = 11.5 GiB of 1 MiB pages (16 x 65,536 B) = 11,776 -> 23 sequences, 2 pairs.
    argv = ["--name", "llama-3-8b", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
            "--hidden-size", "4096", "--intermediate-size", "14336", "--vocab-size", "128256",
            "--context-len", "8192", "--gpus", "8", "--gpu-memory-gb", "24", "--overhead-gb", "4"]
    assert sizing.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=1: weights 15.0 GiB per GPU + KV 5 GiB: 2,560 pages -> 5 sequences" in out
    assert "TP=2: weights 8.5 GiB per GPU + KV 11.5 GiB: 11,776 pages -> 23 sequences" in out
    assert "suggested (the smallest TP holding 8 sequences of 8,192 tokens): TP=2" in out
    # GPU numbering: rank r of a worker on cuda:K runs on cuda:K+r, prefill first in each pair.
    assert ("pair 0: prefill on GPUs 0-1 (--device cuda:0), decode on GPUs 2-3 (--device cuda:2), "
            "--tensor-parallel-size 2 --kv-cache-memory-gb 11.5") in out
    assert "pair 1: prefill on GPUs 4-5 (--device cuda:4), decode on GPUs 6-7 (--device cuda:6)" in out


def test_report_per_gpu_lines(capsys):
    argv = ["--name", "llama-3-8b", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--kv-cache-memory-gb", "56", "--context-len", "8192", "--tensor-parallel-size", "2"]
    assert sizing.main(argv) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2: a worker on 2 GPUs, each with 4 KV heads (65,536 B per token)\n" in out
    assert "page of 16 tokens: 1,048,576 B per GPU\npool of 56 GiB per GPU: 57,344 pages = 917,504 tokens" in out
    assert "context 8,192 tokens: 512 pages each -> 112 concurrent sequences" in out  # 57,344 / 512
    # TP=1 output keeps its shape (docs/deploy.md shows it).
    assert sizing.main(argv[:-2]) == 0
    assert "pool of 56 GiB: 28,672 pages" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64", "--tensor-parallel-size", "2"],
     "9 attention heads, which do not split over 2 GPUs"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpus", "8", "--gpu-memory-gb", "80"],
     "comparing layouts needs the weights"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpus", "1", "--gpu-memory-gb", "80"],
     "at least 2 GPUs"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tensor-parallel-size", "0"], "must be positive"),
])
def test_cli_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sizing.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
