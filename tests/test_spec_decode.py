"""Speculative decoding: greedy output identical to plain decoding, sampled output distributed as
plain sampling, pages and limits right around accepted runs (splitserve/engine/spec_decode)."""
import math
import random

import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine import rejection_sampler as rejection
from splitserve.engine.spec_decode.ngram import ngram_propose
from splitserve.engine.spec_decode.proposer import Proposer
from splitserve.engine.spec_state import SpecState
from tests.test_engine_correctness import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---- prompt lookup ------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # The suffix [5, 6] occurs at 0 and 5: the latest (5) is followed by 7, 1, 5.
    assert ngram_propose(tokens, 3, 1, 3) == [7, 1, 5]
    assert ngram_propose(tokens, 1, 1, 3) == [7]
    # Longest n first: [9, 5, 6] (n=3) occurs once, at 4 -> what follows it.
    assert ngram_propose([9, 5, 6, 7, 1, 5, 6, 2, 9, 5, 6], 2, 2, 3) == [7, 1]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert ngram_propose([1, 2, 3, 2], 3, 2, 3) == []  # only a 1-gram recurs; min is 2
    assert ngram_propose([1, 2, 3, 2], 3, 1, 3) == [3, 2]
    assert ngram_propose([4], 3, 1, 3) == []


def test_back_off_switches_proposals_off_and_on_again():
    state = SpecState()
    for _ in range(20):
        if state.skip_steps:
            break
        state.record(proposed=3, accepted=0)
    assert state.skip_steps > 0
    skipped = 0
    while not state.wants_proposals():
        skipped += 1
    assert skipped == 16 and state.wants_proposals()
    state.record(3, 3)
    assert state.skip_steps == 0


# ---- greedy: identical to plain decoding --------------------------------------------------

def repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that quote themselves, so lookup finds matches (the model rarely copies them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        piece = [rng.randrange(256) for _ in range(rng.randint(3, 12))]
        out.append(piece * rng.randint(2, 4) + piece[:rng.randint(0, len(piece))])
    return out


class OracleProposer(Proposer):
    """Proposes the reference continuation, wrong at a few positions: long accepted runs and
    rejections at every offset (a tiny random model rarely repeats itself for ngram to hit)."""

    def __init__(self, reference: dict[tuple, list[int]], k: int):
        self.reference, self.k = reference, k
        self.calls = 0

    def _propose(self, chunks, plan):
        for chunk in chunks:
            request = chunk.request
            ref = self.reference[tuple(request.prompt_token_ids)]
            at = len(request.output_token_ids)
            spec = list(ref[at:at + chunk.lookahead])
            self.calls += 1
            if spec and self.calls % 3 == 0:
                wrong = self.calls % len(spec)
                spec[wrong] = (spec[wrong] + 1) % 256
            chunk.spec_token_ids = spec


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_greedy_matches_transformers(arch, tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs[arch]
    prompts = repeating_prompts(6, seed=1) + mixed_prompts(6, seed=2)
    llm = make_llm(model, block_size=8, num_gpu_blocks=128, speculative_method="ngram",
                   num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    outputs = llm.generate(prompts, GREEDY)
    ref = hf_reference(model)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, GREEDY.max_tokens)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("k", [1, 4])
def test_verified_runs_match_transformers_under_preemption(mode, k, tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    ref = hf_reference(model)
    prompts = mixed_prompts(8, seed=21, lo=20, hi=35)
    max_tokens = 20
    reference = {tuple(p): ref.greedy(p, max_tokens) for p in prompts}
    # 12 blocks of 8 tokens cannot hold 8 sequences of ~45 tokens: preemption must happen.
    llm = make_llm(model, block_size=8, num_gpu_blocks=12, preemption_mode=mode, num_cpu_blocks=64,
                   speculative_method="ngram", num_speculative_tokens=k)
    llm.engine.proposer = OracleProposer(reference, k)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted runs and rejections
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference[tuple(prompt)]
        assert [entry[0][0] for entry in out.logprobs] == out.token_ids


def test_verified_logprobs_equal_plain_decoding(tiny_model_dirs, make_llm, hf_reference):
    """Logprobs of verified tokens read the same KV as plain decoding's: a KV slot written for a
    rejected proposal and read later would show here even where the argmax does not change."""
    model = tiny_model_dirs["mistral"]
    ref = hf_reference(model)
    prompts = mixed_prompts(5, seed=7, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = make_llm(model, block_size=8, num_gpu_blocks=64).generate(prompts, params)
    llm = make_llm(model, block_size=8, num_gpu_blocks=64, speculative_method="ngram", num_speculative_tokens=3)
    llm.engine.proposer = OracleProposer({tuple(p): ref.greedy(p, 20) for p in prompts}, 3)
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert max(abs(u - v) for (_, u), (_, v) in zip(x, y)) < 1e-4


def test_stop_and_max_tokens_inside_an_accepted_run(tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    ref = hf_reference(model)
    prompt = mixed_prompts(1, seed=4)[0]
    full = ref.greedy(prompt, 16)
    llm = make_llm(model, block_size=8, num_gpu_blocks=64, speculative_method="ngram", num_speculative_tokens=4)
    oracle = OracleProposer({tuple(prompt): full}, 4)
    oracle.calls = 1  # no wrong proposals in the first calls: runs of 4 get accepted
    llm.engine.proposer = oracle
    stop_at = full[6]
    [stopped] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]))
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[:full.index(stop_at) + 1]
    for max_tokens in (2, 5, 7):
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert out.finish_reason == "length" and out.token_ids == full[:max_tokens]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_rejected_proposals_pages_go_back(tiny_model_dirs, make_llm):
    """After a step, a running request holds the pages of its tokens, none for rejected proposals."""
    llm = make_llm(tiny_model_dirs["llama"], block_size=4, num_gpu_blocks=64, speculative_method="ngram",
                   num_speculative_tokens=4)

    class Wrong(Proposer):
        def _propose(self, chunks, plan):
            for chunk in chunks:
                chunk.spec_token_ids = [(chunk.request.all_token_ids[-1] + 1 + i) % 256 for i in range(chunk.lookahead)]

    engine = llm.engine
    engine.proposer = Wrong()
    engine.add_request("r", [1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seen_proposals = False
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        engine.proposer.propose(plan)
        seen_proposals |= any(c.spec_token_ids for c in plan.chunks)
        engine.scheduler.update(plan, engine.runner.run(plan))
        request = engine.requests["r"]
        if not request.is_finished:
            assert len(engine.kv.block_table("r")) == engine.kv.blocks_needed(request.num_tokens)
            assert request.num_computed_tokens == request.num_tokens - 1
        engine.kv.check_invariants()
        engine.requests.pop("r") if request.is_finished else None
    assert seen_proposals


# ---- random sampling: the target's distribution -------------------------------------------

def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, cells with expected count < 5 pooled; (statistic, degrees of freedom)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def _verify_samples(n: int, logits: torch.Tensor, proposals: list[list[int]], draft: torch.Tensor | None,
                    seed: int):
    """Run ``verify`` on n chunks with the same target rows (``logits``: the target after 0..P
    proposals) and the given proposals (drawn from ``draft``'s rows, or point masses when None);
    returns the emitted tokens of each."""
    params = SamplingParams(temperature=1.0, max_tokens=10)
    chunks = []
    for i, proposal in enumerate(proposals):
        request = Request(f"r{i}", [1], params)
        chunks.append(ScheduledChunk(request, 0, 1 + len(proposal), samples=True,
                                     spec_token_ids=list(proposal), draft_probs=draft))
    sampler = Sampler([], generator=torch.Generator().manual_seed(seed))
    out = rejection.verify(sampler, logits.repeat(n, 1), chunks)
    return [[t.token_id for t in out[f"r{i}"]] for i in range(n)]


LOGITS = torch.tensor([[1.0, 0.3, -0.5, 0.8, -1.0, 0.0],   # after the newest token
                       [0.2, 1.5, 0.1, -0.3, 0.7, -2.0],   # after proposal 1
                       [-1.0, 0.0, 2.0, 0.5, 0.4, 0.1]])  # after proposals 1 and 2


def _check_matches_target(tokens: list[list[int]]) -> tuple[float, float]:
    """Chi-square of the first emitted token against p_0 and, where it was an accepted proposal,
    of the second against p_1; returns (statistic / critical value) for each: < 1 passes."""
    p = LOGITS.softmax(-1)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=6).float()
    second = torch.bincount(torch.tensor([t[1] for t in tokens if len(t) > 1]), minlength=6).float()
    ratios = []
    for counts, probs in ((first, p[0]), (second, p[1])):
        stat, df = _chi_square(counts, probs)
        ratios.append(stat / _chi_square_critical(df))
    return ratios[0], ratios[1]


@pytest.mark.parametrize("proposal", [[3, 1], [0, 1], [5, 5]])
def test_ngram_rejection_sampling_keeps_the_target_distribution(proposal):
    tokens = _verify_samples(20000, LOGITS, [proposal] * 20000, None, seed=1)
    assert all(1 <= len(t) <= 3 for t in tokens)
    first, second = _check_matches_target(tokens)
    assert first < 1 and second < 1, (first, second)


def test_a_wrong_acceptance_rule_is_caught(monkeypatch):
    """The classic bug: after rejecting d, sample from p itself (d included). The proposal gets
    emitted too often and the chi-square test above fails."""
    monkeypatch.setattr(rejection, "point_mass_residual", lambda p, proposal: p.clone())
    tokens = _verify_samples(20000, LOGITS, [[3, 1]] * 20000, None, seed=1)
    first, _ = _check_matches_target(tokens)
    assert first > 1


def test_draft_rejection_sampling_keeps_the_target_distribution():
    """Proposals drawn from a draft distribution q: min(1, p/q) acceptance, residual max(0, p - q)."""
    q = torch.tensor([[0.05, 0.05, 0.1, 0.6, 0.1, 0.1], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])
    n = 20000
    draws = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(5)).T.tolist()
    tokens = _verify_samples(n, LOGITS, draws, q, seed=2)
    first, second = _check_matches_target(tokens)
    assert first < 1 and second < 1, (first, second)
    # min(1, p/q) accepts more than ngram's rule (accept with p(d)), which is exact too, for any q.
    point = _verify_samples(n, LOGITS, draws, None, seed=2)
    assert sum(len(t) for t in tokens) > sum(len(t) for t in point)


def test_engine_sampling_with_speculation_matches_transformers(tiny_model_dirs, make_llm, hf_reference):
    """End to end at temperature 1: the joint distribution of the first two tokens (the second is
    the first that verification emits) equals transformers' softmax, with an oracle proposing
    the greedy continuation (accepted often, rejected often)."""
    model = tiny_model_dirs["llama"]
    hf = hf_reference(model).model
    prompt = [17, 42, 99, 5]
    vocab = hf.config.vocab_size
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        both = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = hf(both).logits[:, -1].softmax(-1)  # [t1, t2]
    joint = (p1.unsqueeze(1) * p2).flatten()
    greedy_next = {t: [int(p2[t].argmax())] for t in range(vocab)}

    class ArgmaxProposer(Proposer):
        def _propose(self, chunks, plan):
            for chunk in chunks:
                chunk.spec_token_ids = greedy_next[chunk.request.output_token_ids[-1]][:chunk.lookahead]

    llm = make_llm(model, block_size=8, num_gpu_blocks=512, max_num_seqs=256, speculative_method="ngram",
                   num_speculative_tokens=1)
    llm.engine.proposer = ArgmaxProposer()
    llm.engine.runner.sampler.generator = torch.Generator().manual_seed(3)
    n = 3000
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    stats = llm.engine.scheduler.spec_stats
    # One proposal per request, accepted with probability p(argmax): E = sum_t1 p(t1) max p(. | t1).
    expected = float((p1 * p2.max(dim=-1).values).sum())
    assert stats.num_draft_tokens == n
    assert abs(stats.num_accepted_tokens - expected * n) < 4 * math.sqrt(n * expected * (1 - expected))
    counts = torch.bincount(torch.tensor([o.token_ids[0] * vocab + o.token_ids[1] for o in outs]),
                            minlength=vocab * vocab).float()
    stat, df = _chi_square(counts, joint)
    assert stat < _chi_square_critical(df), (stat, df)


# ---- draft model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A one-layer random draft with the tiny models' vocabulary (their byte tokenizer)."""
    from tests.harness.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", arch="llama", seed=5, num_layers=1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_greedy_matches_transformers(mode, tiny_model_dirs, tiny_draft, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    ref = hf_reference(model)
    prompts = mixed_prompts(8, seed=21, lo=20, hi=35)
    llm = make_llm(model, block_size=8, num_gpu_blocks=12, preemption_mode=mode, num_cpu_blocks=64,
                   speculative_method="draft", speculative_model=str(tiny_draft), num_speculative_tokens=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, 20)


def test_the_model_as_its_own_draft_is_accepted(tiny_model_dirs, make_llm, hf_reference):
    """A draft equal to the target proposes what the target picks: nearly everything is accepted,
    greedy and sampled, which only holds if the draft's KV (caught up, extended, cut back after
    rejections and preemptions) is right."""
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(6, seed=3, lo=5, hi=40)
    llm = make_llm(model, block_size=8, num_gpu_blocks=64, max_num_batched_tokens=32,
                   speculative_method="draft", speculative_model=str(model), num_speculative_tokens=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    ref = hf_reference(model)
    assert all(o.token_ids == ref.greedy(p, 20) for p, o in zip(prompts, outputs))
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1))
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


def test_draft_must_share_the_vocabulary(tiny_model_dirs, tmp_path, make_llm):
    from tests.harness.tiny_models import make_tiny_model
    other = make_tiny_model(tmp_path / "other", arch="llama")
    import json
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="vocabulary"):
        make_llm(tiny_model_dirs["llama"], speculative_method="draft", speculative_model=str(other))
