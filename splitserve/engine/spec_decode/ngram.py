"""Prompt lookup (vLLM's ``ngram`` method): the tokens that followed the sequence's last n-gram
where that n-gram occurred before, in the prompt or the output. Free to compute, and right
whenever the output quotes its input (copying, editing code, extracting, summarising with quotes)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of the sequence's last n tokens,
    trying n from ``n_max`` down to ``n_min``; [] when no n-gram recurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = arr[length - n:]
        # Windows start at 0 .. length-1-n: every earlier occurrence that a token follows (the
        # suffix itself, at length-n, is left out).
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The latest occurrence: in a repetitive output the nearest context predicts best.
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
