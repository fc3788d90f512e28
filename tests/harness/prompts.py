"""Prompts for tests and benchmarks: reproducible random token ids."""
from __future__ import annotations

import random


def mixed_prompts(n: int, seed: int, lo: int = 1, hi: int = 60, vocab: int = 256) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` token ids below ``vocab``, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
