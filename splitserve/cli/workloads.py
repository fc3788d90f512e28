"""The benchmark workloads (docs/contributing.md, Benchmarks), as deterministic token ids and output lengths:
``mixed`` (the default of ``splitserve tune``), ``shared_prefix``, ``interference``, ``prefix_probe``."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    # What the request stands for in its workload ("decode", "long", "hit", "miss", ...):
    # summaries can be split by it.
    kind: str = ""


def _tokens(rng: random.Random, n: int, vocab_size: int, low: int = 100) -> list[int]:
    # Ids above the special-token range, so a prompt never contains an EOS or chat marker.
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _mixed_output_len(rng: random.Random) -> int:
    return min(256, max(8, round(rng.expovariate(1 / 64))))


def mixed(n: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Prompts of 32-256 tokens; outputs exponential with mean 64, clipped to 8-256 (ignore_eos)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(32, 256)
        max_tokens = _mixed_output_len(rng)
        out.append(BenchRequest(_tokens(rng, prompt_len, vocab_size), max_tokens))
    return out


def variance_sweep(n: int, vocab_size: int, clip: int, seed: int = 0) -> list[BenchRequest]:
    """Fixed 128-token prompts; outputs exponential with mean 32, clipped at ``clip``."""
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, 128, vocab_size), min(clip, max(1, round(rng.expovariate(1 / 32)))))
            for _ in range(n)]


def shared_prefix(n: int, vocab_size: int, seed: int = 0, *, prefix_len: tuple[int, int] = (512, 1024),
                  suffix_len: tuple[int, int] = (8, 32), outputs: str = "fixed32") -> list[BenchRequest]:
    """One system prompt (``prefix_len`` tokens) plus short unique suffixes (``suffix_len``).

    ``outputs``: ``fixed32`` (32 tokens each) or ``mixed`` (the mixed workload's lengths).
    """
    rng = random.Random(seed)
    system = _tokens(rng, rng.randint(*prefix_len), vocab_size)
    out = []
    for _ in range(n):
        suffix = _tokens(rng, rng.randint(*suffix_len), vocab_size)
        out.append(BenchRequest(system + suffix, 32 if outputs == "fixed32" else _mixed_output_len(rng)))
    return out


def fresh_tokens(requests: list[BenchRequest], vocab_size: int, seed: int, shared_prefix_len: int = 0
                 ) -> list[BenchRequest]:
    """The same requests (lengths, kinds) with new random prompt ids: the same work again
    without hitting the prefix cache that the last run filled. With ``shared_prefix_len`` the
    first that many ids are one new prefix common to every request, as in ``shared_prefix``."""
    rng = random.Random(seed)
    prefix = _tokens(rng, shared_prefix_len, vocab_size)
    return [BenchRequest(prefix + _tokens(rng, len(r.prompt_token_ids) - shared_prefix_len, vocab_size),
                         r.max_tokens, r.kind) for r in requests]


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` Poisson arrivals at ``rate``/s; all 0 when rate is inf.

    The first request goes at 0; the gaps are ``random.Random(seed).expovariate(rate)``.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def interference(num_decodes: int, num_long: int, vocab_size: int, seed: int = 0, *,
                 decode_prompt: tuple[int, int] = (32, 64), decode_tokens: int = 96,
                 long_prompt: tuple[int, int] = (1024, 2048), long_tokens: int = 8,
                 long_start_s: float = 1.0, long_every_s: float = 3.0) -> tuple[list[BenchRequest], list[float]]:
    """Steady decodes while long prompts arrive (the ``interference`` workload).

    ``num_decodes`` short requests ("decode": prompts in ``decode_prompt``, ``decode_tokens``
    outputs) all start at t=0; ``num_long`` long prompts ("long": lengths in ``long_prompt``,
    ``long_tokens`` outputs) arrive at ``long_start_s``, then every ``long_every_s``, while
    the short ones decode. Returns the requests and their send offsets (s).
    """
    rng = random.Random(seed)
    requests, offsets = [], []
    for _ in range(num_decodes):
        requests.append(BenchRequest(_tokens(rng, rng.randint(*decode_prompt), vocab_size), decode_tokens, "decode"))
        offsets.append(0.0)
    for i in range(num_long):
        requests.append(BenchRequest(_tokens(rng, rng.randint(*long_prompt), vocab_size), long_tokens, "long"))
        offsets.append(long_start_s + i * long_every_s)
    return requests, offsets


def prefix_probe(num_hits: int, prefix_tokens: int, vocab_size: int, seed: int = 0, *,
                 suffix_tokens: int = 16, max_tokens: int = 8) -> dict[str, list[BenchRequest]]:
    """Prefix-cache hit vs miss, sent one at a time.

    ``hit``: one request with a fresh ``prefix_tokens``-token prefix (kind "first": it misses
    and fills the cache), then ``num_hits`` requests sharing that prefix with unique
    ``suffix_tokens``-token suffixes (kind "hit"). ``miss`` (the control): ``num_hits``
    requests of the same lengths, each with its own fresh prefix (kind "miss"). Use a new
    seed per round so no round finds an earlier round's prefix in the cache.
    """
    rng = random.Random(seed)
    shared = _tokens(rng, prefix_tokens, vocab_size)
    hit = [BenchRequest(shared + _tokens(rng, suffix_tokens, vocab_size), max_tokens, "first")]
    hit += [BenchRequest(shared + _tokens(rng, suffix_tokens, vocab_size), max_tokens, "hit") for _ in range(num_hits)]
    miss = [BenchRequest(_tokens(rng, prefix_tokens + suffix_tokens, vocab_size), max_tokens, "miss")
            for _ in range(num_hits)]
    return {"hit": hit, "miss": miss}


WORKLOADS = {"mixed": mixed, "shared_prefix": shared_prefix}
