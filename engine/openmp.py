"""OpenMP threads that sleep when they wait, set before torch loads its OpenMP runtime.

torch's CPU ops run on GNU OpenMP, whose threads spin while they wait for the next parallel
region. On a core shared with anything else (the other worker of ``splitserve up``, the
gateway, Redis, a neighbour's job) a spinning thread holds the core its partner needs, and
every one of the few hundred parallel regions of a step waits for the slowest thread: on this
project's 2-core machines, with other processes running, a decode step of 8 sequences took
3.7 s with the default policy and 0.19-0.22 s with ``OMP_WAIT_POLICY=PASSIVE``
(``python -m bench.step_time``, eager, 2 threads). A user's own setting wins.
"""
from __future__ import annotations

import os
import sys


def prefer_passive_waiting() -> None:
    """Ask for passive waiting unless torch (and so libgomp, which reads it once) is already loaded."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
