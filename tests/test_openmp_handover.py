"""splitserve/engine/openmp.py: the thread that built a model lets its OpenMP pool go, and the engine-loop
thread that steps the model computes with the builder's torch thread count, its team bound one
thread a core where it has a thread for each.

Each check runs in a fresh interpreter: OpenMP's pools and thread counts are per process and per
thread, and the test process's own would blur what is counted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_releasing_the_pool_ends_the_calling_threads_openmp_workers():
    out = run_python("""
        import os, time, torch
        from splitserve.engine.openmp import release_thread_pool
        torch.set_num_threads(3)
        def threads():
            return len(os.listdir("/proc/self/task"))
        before = threads()
        torch.randn(1 << 22).sin_()  # a parallel region: this thread's pool gets 2 workers
        with_pool = threads()
        released = release_thread_pool()
        deadline = time.monotonic() + 10
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        print(before, with_pool, released, threads())
    """)
    before, with_pool, released, after = out.split()
    assert int(with_pool) == int(before) + 2, out
    assert released == "True"
    assert int(after) == int(before), out


def test_the_engine_loop_thread_computes_with_the_builders_thread_count():
    threads = (os.cpu_count() or 1) + 1  # not the count a new thread would start from by itself
    out = run_python(f"""
        import ctypes, threading, torch
        from splitserve.engine.openmp import _loaded_libgomp
        from splitserve.worker.engine_loop import EngineLoop
        torch.set_num_threads({threads})
        torch.randn(1 << 22).sin_()
        libgomp = _loaded_libgomp()
        seen = []
        def step():
            seen.append(libgomp.omp_get_max_threads())  # asked before torch could set it lazily
            return []
        loop = EngineLoop(step, has_work=lambda: not seen).start()
        loop.call(lambda: None)
        loop.stop()
        plain = []
        t = threading.Thread(target=lambda: plain.append(libgomp.omp_get_max_threads()))
        t.start(); t.join()
        print(seen[0], plain[0])
    """)
    in_loop, in_plain_thread = map(int, out.split())
    assert in_loop == threads
    assert in_plain_thread != threads  # what the loop thread would have had without the handover


def test_the_engine_loop_thread_and_the_torch_threads_it_starts_run_at_its_lower_priority():
    """``EngineLoop(niceness=3)``: the loop thread's nice value is the process's + 3, and so is that of
    the OpenMP workers its first parallel region starts; the thread that made the loop keeps its own."""
    out = run_python("""
        import os, threading, torch
        from splitserve.worker.engine_loop import EngineLoop
        torch.set_num_threads(3)
        torch.randn(1 << 22).sin_()  # the building thread's pool, released by the handover
        def nice(tid):
            return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
        before = set(os.listdir("/proc/self/task"))
        done = []
        stepped = threading.Event()
        def step():
            torch.randn(1 << 22).sin_()  # the loop thread's own pool: 2 workers
            done.append(threading.get_native_id())
            stepped.set()
            return []
        loop = EngineLoop(step, has_work=lambda: not done, niceness=3).start()
        assert stepped.wait(60)
        started = set(os.listdir("/proc/self/task")) - before
        values = sorted(nice(tid) for tid in started)
        loop.stop()
        print(nice(threading.get_native_id()), done[0] in map(int, started), *values)
    """)
    main, loop_in_started, *started = out.split()
    assert loop_in_started == "True", out
    assert len(started) == 3 and set(started) == {str(int(main) + 3)}, out  # the loop thread and its 2 OpenMP workers


def test_an_engine_loop_with_a_torch_thread_for_each_core_binds_them_one_a_core():
    """``EngineLoop(bind_threads=True)``, as many torch threads as cores this process may use: the
    loop thread is bound to the first core and each OpenMP worker of its team to another, and the
    step's parallel regions run on those same threads (no new ones). A team smaller than the cores is
    left unbound (``team_cores``), and the thread that made the loop keeps every core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("binding a team one thread a core takes at least 2 cores")
    out = run_python(f"""
        import json, os, threading, torch
        from splitserve.engine.openmp import team_cores
        from splitserve.worker.engine_loop import EngineLoop
        torch.set_num_threads({len(cores)})
        before = set(os.listdir("/proc/self/task"))
        seen = []
        stepped = threading.Event()
        def step():
            bound = set(os.listdir("/proc/self/task"))  # the pool binding started
            torch.randn(1 << 22).sin_()
            seen.append((threading.get_native_id(), bound, set(os.listdir("/proc/self/task"))))
            stepped.set()
            return []
        loop = EngineLoop(step, has_work=lambda: not seen, bind_threads=True).start()
        assert stepped.wait(60)
        loop_tid, bound, after = seen[0]
        workers = bound - before - {{str(loop_tid)}}
        cores = lambda tid: sorted(os.sched_getaffinity(int(tid)))
        print(json.dumps({{"bound_cores": loop.bound_cores, "loop": cores(loop_tid),
                          "workers": sorted(cores(t) for t in workers), "new_in_step": sorted(after - bound),
                          "smaller_team": team_cores({len(cores)} - 1), "one": team_cores(1),
                          "maker": cores(threading.get_native_id())}}))
        loop.stop()
    """)
    seen = json.loads(out)
    assert seen["bound_cores"] == cores and seen["loop"] == [cores[0]], seen
    assert seen["workers"] == [[c] for c in cores[1:]], seen
    assert seen["new_in_step"] == [], seen
    assert seen["smaller_team"] == [] and seen["one"] == [] and seen["maker"] == cores, seen
