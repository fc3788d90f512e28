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


# --- handing a model's compute to another thread ---------------------------------------------
#
# libgomp gives every thread that opens a parallel region a pool of its own worker threads, and
# counts all of them: once more threads are "managed" than there are cores, it stops spinning at
# barriers (a throttled spin count of ~100) and every thread of every team waits passively, as
# OMP_WAIT_POLICY=PASSIVE would make it. A worker loads and compiles its model on the main thread
# (whose pool then stays alive, idle) and steps it on an engine-loop thread (a second pool), so on a
# 2-core box with 2 torch threads the steps ran with passive waits: measured at batch 8 / 64
# (SmolLM2 fp32 compiled, context 200), 119-176 / 310-323 ms a step on the loop thread against
# 60-82 / 225-265 on the main thread. Freeing the loading thread's pool before the loop thread
# starts (``omp_pause_resource_all``, OpenMP 5.0) brings the loop thread's steps back to 60 / 256 ms.

def _loaded_libgomp():
    """The libgomp this process has loaded (torch's own copy, usually), or None."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libgomp"):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None


def release_thread_pool() -> bool:
    """Let the OpenMP worker threads of the calling thread's pool exit (they come back if it opens
    a parallel region again). True when libgomp did it; False where there is no libgomp to ask."""
    if "torch" not in sys.modules:
        return False
    libgomp = _loaded_libgomp()
    pause = getattr(libgomp, "omp_pause_resource_all", None) if libgomp is not None else None
    if pause is None:
        return False
    return pause(1) == 0  # omp_pause_soft


# --- one thread a core ------------------------------------------------------------------------
#
# Where two workers share a small CPU, each with a thread per core (``splitserve up --prefill 1
# --decode 1`` on 2 cores), Linux sometimes left both threads of one worker's team on one core: the
# thread at a barrier spins for its partner, which waits for the spinner's scheduler slice to end, so
# the two took turns of ~3 ms for a whole prefill (csrc/thread_binding_cpu.cpp says what perf
# showed). Bound, thread i of a team stays on core i, and each core's priorities decide between the
# workers. vLLM's CPU backend binds its OpenMP threads to cores too.
#
# Only teams of two threads are bound: libgomp lets a pool's surplus threads exit when a smaller team
# runs (oneDNN sizes its teams by the work) and starts new ones from the master later, and those
# would inherit the master's single core. A team of two has no smaller team but the master alone.
BOUND_TEAM_SIZE = 2
# A user's own OpenMP placement wins over ours.
PLACEMENT_VARIABLES = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")

# The cores this process may use, noted before a team is bound (threads started later from a bound
# thread inherit its one core; ``unbind_current_thread`` gives them these back).
_process_cores: list[int] = []


def team_cores(threads: int) -> list[int]:
    """The cores a team of ``threads`` binds to, thread i to the i-th: the two cores this process
    may use, when the team has a thread for each; else none (a team smaller than its cores is left
    to the scheduler, which can move it off a busy core; larger ones: see above)."""
    if not hasattr(os, "sched_getaffinity") or any(os.environ.get(v) for v in PLACEMENT_VARIABLES):
        return []
    cores = sorted(os.sched_getaffinity(0))
    return cores if threads == len(cores) == BOUND_TEAM_SIZE else []


def _one_libgomp() -> bool:
    """Whether exactly one libgomp is loaded: the op's parallel region must run in torch's."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.rsplit(None, 1)[-1] for line in maps if "libgomp" in line}
    except OSError:
        return False
    return len({os.path.realpath(path) for path in paths}) == 1


def bind_thread_team(threads: int) -> list[int]:
    """Bind the calling thread's OpenMP team of ``threads`` (itself first) to ``team_cores``; the
    cores bound, or [] where there is nothing to bind or no CPU kernels to bind with (a partial
    binding is undone). Threads the calling thread starts afterwards inherit its core: a pool of
    them calls ``unbind_current_thread`` first."""
    cores = team_cores(threads)
    if not cores:
        return []
    from splitserve.engine.attention import cpu_kernels
    if not cpu_kernels.available() or not _one_libgomp():
        return []
    import torch
    _process_cores[:] = sorted(os.sched_getaffinity(0))
    if torch.ops.splitserve_cpu.bind_openmp_team(cores, True) == len(cores):
        return cores
    torch.ops.splitserve_cpu.bind_openmp_team(_process_cores, False)
    return []


def unbind_current_thread() -> None:
    """Let the calling thread run on every core the process may use again, where a team was bound
    (a ``ThreadPoolExecutor`` initializer for pools whose threads an engine thread starts)."""
    if _process_cores:
        os.sched_setaffinity(0, _process_cores)


class ComputeHandover:
    """Move a model's compute from the thread that built it to the thread that will run it.

    Made on the building thread: it notes that thread's torch thread count and frees its OpenMP
    pool (see above). ``adopt()`` on the running thread sets the same torch thread count there
    (OpenMP's thread count is per thread; a new thread starts from the process default) and, asked
    to, binds that thread's team one thread a core (``bind_thread_team``)."""

    def __init__(self):
        self.threads = 0
        if "torch" in sys.modules:
            import torch
            self.threads = torch.get_num_threads()
            release_thread_pool()

    def adopt(self, bind: bool = False) -> list[int]:
        """The cores the team was bound to ([]: not bound)."""
        if self.threads <= 0:
            return []
        import torch
        torch.set_num_threads(self.threads)
        return bind_thread_team(self.threads) if bind else []
