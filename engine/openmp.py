"""OpenMP threads that sleep when they wait, for processes that share their cores.

torch's CPU ops run on GNU OpenMP, whose threads spin a while (GOMP_SPINCOUNT, 300,000 by
default) waiting for the next parallel region before they sleep. On cores of their own that is
what makes a step fast; on cores shared with other busy processes a spinning thread holds the
core its partner needs. Measured with ``python -m bench.step_time`` (compiled, 2 threads,
SmolLM2 fp32, context 200) on this project's 2-core VM, decode step ms at batch 1 / 8:

  =====================  ========  ===================================
  policy                 quiet     with one busy process beside it
  =====================  ========  ===================================
  default (spin)         39 / 60   116 / 243
  OMP_WAIT_POLICY=PASSIVE 89 / 112  66 / 111
  =====================  ========  ===================================

So the engine leaves OpenMP's default alone (a serving box gives its workers their cores, as
vLLM-CPU assumes too), and the test suite, which runs many processes on 2 cores, asks for
passive waiting for itself and every process it starts. A user's own setting always wins.
"""
from __future__ import annotations

import os
import sys


def prefer_passive_waiting() -> None:
    """Ask for passive waiting unless torch (and so libgomp, which reads it once) is already loaded."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
