"""Tests for splitserve.engine.sampling_params and splitserve.engine.sampler (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,

)
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.token_draw import inverse_cdf

EOS = 0


def row(params=None, prompt=(1, 2), output=(), generator=None, **kw):
    if params is None:
        params = SamplingParams(**kw)
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator)


# ----------------------------------------------------------------------------------------
# SamplingParams validation
# ----------------------------------------------------------------------------------------

INVALID = [
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": "1"}, "min_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": "0.9"}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"seed": "42"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": ["3"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": "3"}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": "5"}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[f"{f}={list(k.values())}" for k, f in INVALID])
def test_invalid_params_raise_naming_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(field + " "), str(exc.value)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert p.seed is None and p.logprobs is None and not p.ignore_eos
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.stop_token_ids == [] and p.stop == []
    assert SamplingParams().stop_token_ids is not p.stop_token_ids  # default_factory
    assert not p.is_greedy and not p.has_penalties

    q = SamplingParams(top_k=-1, temperature=0, stop="###", stop_token_ids=(5, 7), logprobs=0)
    assert q.top_k == 0 and isinstance(q.temperature, float) and q.is_greedy
    assert q.stop == ["###"] and q.stop_token_ids == [5, 7]
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16
    assert SamplingParams(seed=-5).seed == -5
    assert SamplingParams(frequency_penalty=-2, presence_penalty=2).has_penalties


def test_validate_for_vocab():
    p = SamplingParams(stop_token_ids=[3, 9])
    p.validate_for_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        p.validate_for_vocab(9)


# ----------------------------------------------------------------------------------------
# Greedy and filters
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_including_ties(dtype):
    torch.manual_seed(0)
    logits = torch.randn(8, 50).to(dtype)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0  # tie: torch picks the first
    sampler = Sampler([EOS])
    out = sampler(logits, [row(temperature=0.0) for _ in range(8)])
    assert isinstance(out, SamplerOutput) and out.logprobs is None
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    # A vocabulary the size of a real one, in whole numbers: ties in every row, across SIMD lanes.
    wide = (torch.randn(16, 49152) * 2).round().to(dtype)
    assert sampler(wide, [row(temperature=0.0) for _ in range(16)]).token_ids == wide.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_any_dtype_and_input_not_modified(dtype):
    torch.manual_seed(1)
    logits = torch.randn(4, 30).to(dtype)
    before = logits.clone()
    rows = [row(temperature=0.0, repetition_penalty=1.5, output=[1, 2]) for _ in range(4)]
    out = Sampler([EOS])(logits, rows)
    assert torch.equal(logits, before)
    expected = apply_penalties(logits.float().clone(), rows).argmax(-1).tolist()
    assert out.token_ids == expected


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(2)
    vocab = 200
    logits = torch.randn(6, vocab) * 3
    rows = [
        row(temperature=0.0),
        row(temperature=1.0, seed=1),
        row(top_k=1, temperature=0.8),
        row(temperature=1.0),
        row(temperature=0.0, logprobs=2),
        row(temperature=0.7, top_p=0.9, top_k=20, seed=5),
    ]
    out = Sampler([EOS])(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert len(out.token_ids) == 6
    for i in (0, 2, 4):
        assert out.token_ids[i] == argmax[i]
    assert all(0 <= t < vocab for t in out.token_ids)
    # row 5: token must be within its top-20
    assert out.token_ids[5] in logits[5].topk(20).indices.tolist()
    assert out.logprobs[4] is not None and out.logprobs[0] is None


def test_top_k_one_equals_greedy():
    torch.manual_seed(3)
    logits = torch.randn(16, 100)
    rows = [row(temperature=1.5, top_k=1, seed=i) for i in range(16)]
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    torch.manual_seed(4)
    logits = torch.randn(16, 100)
    rows = [row(temperature=1.0, top_p=1e-6, seed=i) for i in range(16)]
    assert not rows[0].params.is_greedy  # goes through the random path
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_min_p_one_equals_greedy_and_filters():
    torch.manual_seed(5)
    logits = torch.randn(16, 100)
    rows = [row(temperature=1.0, min_p=1.0, seed=i) for i in range(16)]
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()

    # probs relative to max: token0 1.0, token1 0.5, token2 0.2, token3 0.05 ...
    base = torch.log(torch.tensor([1.0, 0.5, 0.2, 0.05, 0.01, 0.001]))
    n = 2000
    rows = [row(temperature=1.0, min_p=0.15) for _ in range(n)]
    sampler = Sampler([], generator=torch.Generator().manual_seed(0))
    toks = torch.tensor(sampler(base.expand(n, -1), rows).token_ids)
    assert set(toks.tolist()) == {0, 1, 2}
    freq = torch.bincount(toks, minlength=6).float() / n
    expected = torch.tensor([1.0, 0.5, 0.2]) / 1.7
    assert torch.allclose(freq[:3], expected, atol=0.04)


def test_tiny_temperature_is_almost_greedy():
    torch.manual_seed(6)
    logits = torch.randn(32, 100) * 2
    rows = [row(temperature=1e-3, seed=i) for i in range(32)]
    assert not rows[0].params.is_greedy
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    torch.manual_seed(7)
    logits = torch.randn(1, 50)
    top5 = set(logits[0].topk(5).indices.tolist())
    n = 500
    rows = [row(temperature=2.0, top_k=5) for _ in range(n)]
    toks = Sampler([], generator=torch.Generator().manual_seed(1))(logits.expand(n, -1), rows)
    assert set(toks.token_ids) <= top5
    assert len(set(toks.token_ids)) == 5


def _reference_support(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward per-row reference of the kept token set (threshold semantics)."""
    x = logits_row.double() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        kth = x.sort(descending=True).values[top_k - 1]
        keep &= x >= kth
    xk = x.masked_fill(~keep, float("-inf"))
    probs = xk.softmax(-1)
    if top_p < 1.0:
        order = xk.argsort(descending=True)
        cum = probs[order].cumsum(0)
        first = int((cum >= top_p).nonzero()[0])
        keep &= x >= x[order[first]]
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    return set(keep.nonzero().flatten().tolist())


@pytest.mark.parametrize("tiers", [None, (1, 2), (2, 3), (3, 10_000)])
@pytest.mark.parametrize(
    "kw",
    [
        {"top_p": 0.6},
        {"top_p": 0.95, "temperature": 2.0},
        {"top_p": 0.7, "top_k": 6},
        {"top_p": 0.9, "min_p": 0.3, "temperature": 0.5},
        {"top_k": 4, "min_p": 0.5},
    ],
)
def test_filters_match_reference_support_for_every_top_p_tier(monkeypatch, tiers, kw):
    import splitserve.engine.sampler as sampler_mod

    if tiers is not None:  # force the candidate-tier fallbacks on a small vocabulary
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES", tiers[0])
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES_2", tiers[1])
    logits = torch.tensor([1.0, 3.0, 2.5, 0.0, 2.5, -1.0, 1.5, 2.9, 0.5, -2.0])
    expected = _reference_support(logits, **kw)
    n = 3000
    rows = [row(seed=i, **kw) for i in range(n)]
    toks = Sampler([])(logits.expand(n, -1), rows).token_ids
    assert set(toks) == expected


def test_top_p_tiers_give_identical_seeded_tokens(monkeypatch):
    import splitserve.engine.sampler as sampler_mod

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 500, generator=gen) * 0.5  # flat: nucleus of hundreds of tokens

    def run():
        rows = [row(seed=i, top_p=0.8, temperature=1.3) for i in range(16)]
        return Sampler([])(logits, rows).token_ids

    default = run()
    for tiers in [(1, 2), (8, 64), (600, 600), (16, 10_000)]:
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES", tiers[0])
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES_2", tiers[1])
        assert run() == default, tiers


def test_random_path_does_not_modify_input_and_accepts_views():
    torch.manual_seed(9)
    padded = torch.randn(4, 40)
    logits = padded[:, :32]  # non-contiguous view, e.g. a padded vocabulary
    before = padded.clone()
    rows = [
        row(top_k=5, seed=1, output=[3, 3]),
        row(top_p=0.5, seed=2, repetition_penalty=1.2, output=[4]),
        row(min_tokens=2, seed=3),
        row(temperature=0.0, presence_penalty=1.0, output=[1]),
    ]
    out = Sampler([EOS])(logits, rows)
    assert torch.equal(padded, before)
    assert all(0 <= t < 32 for t in out.token_ids)
    assert out.token_ids[2] != EOS


# ----------------------------------------------------------------------------------------
# Reproducibility and distribution
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 10},
        {"temperature": 1.2, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02},
        {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
    ],
)
def test_seed_reproducible_alone_or_batched(kw):
    vocab, steps = 300, 12
    gen = torch.Generator().manual_seed(123)
    step_logits = [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]
    params = SamplingParams(seed=42, **kw)

    def run(batch_index, companions):
        sampler = Sampler([EOS])
        target = row(params, prompt=[3, 4, 5])
        others = [row(SamplingParams(**c), prompt=[7]) for c in companions]
        toks = []
        for s in range(steps):
            batch_rows = list(others)
            batch_rows.insert(batch_index, target)
            logits = torch.randn(len(batch_rows), vocab) * 3
            logits[batch_index] = step_logits[s]
            out = sampler(logits, batch_rows)
            tok = out.token_ids[batch_index]
            target.output_token_ids.append(tok)
            toks.append(tok)
            for i, r in enumerate(others):
                r.output_token_ids.append(out.token_ids[i if i < batch_index else i + 1])
        return toks

    alone = run(0, [])
    companions = [
        {"temperature": 0.0},
        {"temperature": 1.0, "top_p": 0.5},
        {"temperature": 0.7, "seed": 42},  # same seed, different request
        {"temperature": 1.0, "top_k": 3, "presence_penalty": 1.0},
        {"temperature": 1.0},
    ]
    batched = run(3, companions)
    assert alone == batched
    assert run(5, companions[::-1]) == alone
    assert len(set(alone)) > 1  # actually random, not stuck


def test_different_seeds_differ():
    logits = torch.zeros(8, 1000)
    rows = [row(seed=s) for s in range(8)]
    assert len(set(Sampler([])(logits, rows).token_ids)) > 4


@pytest.mark.parametrize(
    "kw,keep",
    [
        ({"temperature": 0.7}, None),
        ({"temperature": 1.3, "top_k": 3}, [0, 1, 2]),
        ({"temperature": 1.0, "top_p": 0.75}, None),
    ],
)
def test_empirical_distribution_matches(kw, keep):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 4000
    sampler = Sampler([], generator=torch.Generator().manual_seed(11))
    rows = [row(**kw) for _ in range(n)]
    toks = torch.tensor(sampler(logits.expand(n, -1), rows).token_ids)
    freq = torch.bincount(toks, minlength=6).float() / n

    probs = torch.softmax(logits / kw["temperature"], -1)
    if keep is not None:
        mask = torch.zeros(6, dtype=torch.bool)
        mask[keep] = True
        probs = torch.where(mask, probs, 0.0)
    if kw.get("top_p", 1.0) < 1.0:
        # smallest prefix (probs sorted desc) with mass >= top_p
        cum = probs.cumsum(0)
        n_keep = int((cum < kw["top_p"]).sum()) + 1
        probs[n_keep:] = 0.0
    probs = probs / probs.sum()
    assert torch.allclose(freq, probs, atol=0.03), (freq, probs)
    assert freq[probs == 0].sum() == 0


def test_inverse_cdf_picks_the_slice_holding_u_and_never_an_empty_one():
    # Masses 0, 0.25, 0, 0.5, 0.25, 0 (unnormalised x4): slices [0, .25) -> 1, [.25, .75) -> 3, [.75, 1) -> 4.
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0, 1.0, 0.0]]).expand(7, -1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999, 1.0 - 2.0 ** -24])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # A row whose mass is all on its last token, and one whose mass is all on its first.
    edge = torch.tensor([[0.0, 0.0, 3.0], [3.0, 0.0, 0.0]])
    for value in (0.0, 0.5, 1.0 - 2.0 ** -24):
        assert inverse_cdf(edge, torch.full((2,), value)).tolist() == [2, 0]



def test_inverse_cdf_across_blocks_matches_the_distribution():
    # 1,000 tokens: four blocks of 256, the last one padded; mass on both sides of a block
    # boundary (255, 256), deep inside blocks and on the very last token. Uniforms on an even grid
    # give each token a count within one of its share.
    vocab, masses = 1000, {3: 0.1, 255: 0.2, 256: 0.15, 600: 0.05, 700: 0.3, 999: 0.2}
    probs = torch.zeros(vocab)
    for token, mass in masses.items():
        probs[token] = mass
    grid = 20_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    counts = torch.bincount(inverse_cdf(probs.expand(grid, -1), u.float()), minlength=vocab)
    assert set(counts.nonzero().flatten().tolist()) == set(masses)
    for token, mass in masses.items():
        assert abs(int(counts[token]) - mass * grid) <= 1, (token, int(counts[token]))

# ----------------------------------------------------------------------------------------
# Penalties and min_tokens
# ----------------------------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]


def _pen(prompt, output, **kw):
    logits = torch.tensor([BASE])
    return apply_penalties(logits, [row(prompt=prompt, output=output, **kw)])[0].tolist()


def test_repetition_penalty_hf_style():
    got = _pen([0], [1, 1, 3], repetition_penalty=2.0)
    # appeared in prompt or output: 0 (pos -> /2), 1 and 3 (neg -> *2)
    assert got == pytest.approx([1.0, -2.0, 0.5, -1.0, 3.0, 1.0])


def test_frequency_penalty():
    got = _pen([0], [1, 1, 3, 4, 4, 4], frequency_penalty=0.5)
    assert got == pytest.approx([2.0, -2.0, 0.5, -1.0, 1.5, 1.0])  # prompt not counted


def test_presence_penalty():
    got = _pen([0], [1, 1, 3], presence_penalty=0.3)
    assert got == pytest.approx([2.0, -1.3, 0.5, -0.8, 3.0, 1.0])


def test_combined_penalties_and_untouched_rows():
    logits = torch.tensor([BASE, BASE, BASE])
    rows = [
        row(prompt=[5], output=[1, 1, 3]),  # no penalties
        row(prompt=[5], output=[1, 1, 3], repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=1.0),
        row(prompt=[], output=[]),
    ]
    out = apply_penalties(logits, rows)
    assert out[0].tolist() == BASE and out[2].tolist() == BASE
    # rep 0.5: 5 (pos) -> 2.0; 1 (neg) -> -0.5; 3 (neg) -> -0.25
    # freq -1: 1 += 2, 3 += 1; presence 1: 1 -= 1, 3 -= 1
    assert out[1].tolist() == pytest.approx([2.0, -0.5 + 2 - 1, 0.5, -0.25 + 1 - 1, 3.0, 2.0])


def test_penalties_ignore_out_of_vocab_ids():
    got = _pen([0, 99], [1, -1, 1000], repetition_penalty=2.0)
    assert got == pytest.approx([1.0, -2.0, 0.5, -0.5, 3.0, 1.0])


def test_min_tokens_blocks_eos_and_stop_ids():
    vocab = 10
    logits = torch.zeros(1, vocab)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 4] = 1.0
    sampler = Sampler([EOS, 9])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    for n_out, expected in [(0, 4), (1, 4), (2, 4), (3, EOS)]:
        out = sampler(logits, [row(params, output=[4] * n_out)])
        assert out.token_ids == [expected]

    # ignore_eos: EOS is not a stop token, only stop_token_ids are blocked
    p2 = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert sampler(logits, [row(p2)]).token_ids == [EOS]
    l2 = logits.clone()
    l2[0, EOS] = 0.0
    assert sampler(l2, [row(p2)]).token_ids == [4]

    # random rows never produce blocked ids while below min_tokens
    flat = torch.zeros(200, vocab)
    flat[:, EOS] = 5.0
    flat[:, 9] = 5.0
    flat[:, 7] = 5.0
    rows = [row(SamplingParams(min_tokens=2, stop_token_ids=[7]), output=[1]) for _ in range(200)]
    toks = sampler(flat, rows).token_ids
    assert not set(toks) & {EOS, 7, 9}

    # helper directly
    l3 = torch.zeros(2, vocab)
    apply_min_tokens(l3, [row(params), row(SamplingParams())], [EOS, 9])
    assert torch.isinf(l3[0, [EOS, 7, 9]]).all() and torch.isfinite(l3[1]).all()


def test_min_tokens_does_not_leave_a_row_without_finite_logits():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [0.0, 1.0, 2.0]])
    params = SamplingParams(min_tokens=2)
    rows = [row(params), row(params)]
    out = Sampler([0, 1])(logits, rows)
    assert out.token_ids[0] in (0, 1)  # masking left nothing: row left unmasked
    assert out.token_ids[1] == 2


def test_min_tokens_never_masks_whole_vocab():
    logits = torch.zeros(1, 3)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1, 2])
    out = Sampler([0])(logits, [row(params)])
    assert out.token_ids[0] in (0, 1, 2)


# ----------------------------------------------------------------------------------------
# logprobs
# ----------------------------------------------------------------------------------------


def test_logprobs_sampled_and_top_n():
    torch.manual_seed(8)
    vocab = 64
    logits = torch.randn(5, vocab)
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=1.0, logprobs=3, seed=1),
        row(temperature=1.0),
        row(temperature=0.5, top_k=4, logprobs=0, seed=2),
        row(temperature=1.0, logprobs=20, repetition_penalty=1.7, output=[3, 5]),
    ]
    out = Sampler([EOS])(logits, rows)
    penalised = apply_penalties(logits.clone(), rows)
    ref = torch.log_softmax(penalised, -1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 3), (3, 0), (4, 20)]:
        entry = out.logprobs[i]
        assert len(entry) == n + 1
        tok, lp = entry[0]
        assert tok == out.token_ids[i]
        assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
        top = entry[1:]
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        expected_ids = ref[i].topk(n).indices.tolist() if n else []
        assert [t for t, _ in top] == expected_ids
        for t, v in top:
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
    # greedy row: sampled token is the top-1
    assert out.logprobs[0][0][0] == out.logprobs[0][1][0]


def test_logprobs_none_when_not_requested_and_clamped_to_vocab():
    logits = torch.randn(2, 4)
    assert Sampler([])(logits, [row(), row(temperature=0.0)]).logprobs is None
    out = Sampler([])(logits, [row(logprobs=20), row(temperature=0, logprobs=1)])
    assert len(out.logprobs[0]) == 1 + 4
    assert len(out.logprobs[1]) == 2
    total = sum(math.exp(v) for _, v in out.logprobs[0][1:])
    assert total == pytest.approx(1.0, abs=1e-5)


def test_empty_batch_and_shape_check():
    assert Sampler([])(torch.zeros(0, 5), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler([])(torch.zeros(2, 5), [row()])


# ----------------------------------------------------------------------------------------
# Property test
# ----------------------------------------------------------------------------------------

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 8),
    min_tokens=st.integers(0, 1),
    temperature=st.one_of(st.just(0.0), st.floats(0.0, 5.0)),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 1000]),
    top_p=st.floats(1e-6, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    repetition_penalty=st.floats(0.1, 3.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    presence_penalty=st.floats(-2.0, 2.0),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, 40), max_size=3),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plist=st.lists(params_strategy, min_size=1, max_size=5),
    vocab=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([0.0, 1.0, 30.0]),
    n_out=st.integers(0, 3),
    data_seed=st.integers(0, 1000),
    with_neg_inf=st.booleans(),
)
def test_random_params_never_crash(plist, vocab, dtype, scale, n_out, data_seed, with_neg_inf):
    g = torch.Generator().manual_seed(data_seed)
    logits = (torch.randn(len(plist), vocab, generator=g) * scale).to(dtype)
    if with_neg_inf and vocab > 1:
        logits[:, -1] = float("-inf")
    rows = [
        row(
            p,
            prompt=torch.randint(0, vocab, (3,), generator=g).tolist(),
            output=torch.randint(0, vocab, (n_out,), generator=g).tolist(),
        )
        for p in plist
    ]
    out = Sampler([0, 1])(logits, rows)
    assert len(out.token_ids) == len(plist)
    assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids)
    if with_neg_inf and vocab > 1:
        assert vocab - 1 not in out.token_ids
    if all(p.logprobs is None for p in plist):
        assert out.logprobs is None
    else:
        for p, entry, tok in zip(plist, out.logprobs, out.token_ids):
            if p.logprobs is None:
                assert entry is None
            else:
                assert entry[0][0] == tok and len(entry) == 1 + min(p.logprobs, vocab)
                assert not math.isnan(entry[0][1])
