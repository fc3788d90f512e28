"""The workloads of shared/BENCHMARKS.md, as deterministic token ids and output lengths."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _tokens(rng: random.Random, n: int, vocab_size: int, low: int = 100) -> list[int]:
    # Ids above the special-token range, so a prompt never contains an EOS or chat marker.
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def mixed(n: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Prompts of 32-256 tokens; outputs exponential with mean 64, clipped to 8-256 (ignore_eos)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = rng.randint(32, 256)
        max_tokens = min(256, max(8, round(rng.expovariate(1 / 64))))
        out.append(BenchRequest(_tokens(rng, prompt_len, vocab_size), max_tokens))
    return out


def variance_sweep(n: int, vocab_size: int, clip: int, seed: int = 0) -> list[BenchRequest]:
    """Fixed 128-token prompts; outputs exponential with mean 32, clipped at ``clip``."""
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, 128, vocab_size), min(clip, max(1, round(rng.expovariate(1 / 32)))))
            for _ in range(n)]


def shared_prefix(n: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """One 512-1024-token system prompt plus short unique suffixes."""
    rng = random.Random(seed)
    system = _tokens(rng, rng.randint(512, 1024), vocab_size)
    return [BenchRequest(system + _tokens(rng, rng.randint(8, 32), vocab_size), 32) for _ in range(n)]


WORKLOADS = {"mixed": mixed, "shared_prefix": shared_prefix}
