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
    """``EngineLoop(bind_threads=True)`` with 2 torch threads on 2 cores: the loop thread is bound to
    the first core and its team's OpenMP worker to the second, and the step's parallel regions run on
    those same threads (no new ones). A thread the loop thread starts inherits its core, and one that
    calls ``unbind_current_thread`` (the prefix loader's pool) gets every core back; the thread that
    made the loop keeps every core."""
    from splitserve.engine.attention import cpu_kernels
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.skip("teams are bound on 2 cores only (splitserve/engine/openmp.py)")
    if not cpu_kernels.available():  # built here, before the child's 120 s start
        pytest.skip(f"no CPU kernels to bind with: {cpu_kernels.load_error()}")
    out = run_python("""
        import concurrent.futures, json, os, threading, torch
        from splitserve.engine.openmp import unbind_current_thread
        from splitserve.worker.engine_loop import EngineLoop
        torch.set_num_threads(2)
        cores = lambda tid=0: sorted(os.sched_getaffinity(tid))
        before = set(os.listdir("/proc/self/task"))
        seen = {}
        stepped = threading.Event()
        def step():
            bound = set(os.listdir("/proc/self/task"))  # the pool binding started
            torch.randn(1 << 22).sin_()
            seen["new_in_step"] = sorted(set(os.listdir("/proc/self/task")) - bound)
            seen["loop"], seen["loop_tid"] = cores(), threading.get_native_id()
            seen["workers"] = sorted(cores(int(t)) for t in bound - before - {str(seen["loop_tid"])})
            child = []
            t = threading.Thread(target=lambda: child.append(cores())); t.start(); t.join()
            pool = concurrent.futures.ThreadPoolExecutor(1, initializer=unbind_current_thread)
            seen["child"], seen["unbound_pool"] = child[0], pool.submit(cores).result()
            pool.shutdown()
            stepped.set()
            return []
        loop = EngineLoop(step, has_work=lambda: not seen, bind_threads=True).start()
        assert stepped.wait(60)
        seen["bound_cores"], seen["maker"] = loop.bound_cores, cores()
        loop.stop()
        print(json.dumps(seen))
    """)
    seen = json.loads(out)
    assert seen["bound_cores"] == cores and seen["loop"] == [cores[0]], seen
    assert seen["workers"] == [[cores[1]]], seen
    assert seen["new_in_step"] == [], seen
    assert seen["child"] == [cores[0]] and seen["unbound_pool"] == cores, seen
    assert seen["maker"] == cores, seen


def test_only_a_team_of_two_with_a_thread_for_each_core_is_bound(monkeypatch):
    """Larger teams are not bound: libgomp replaces a pool's threads after a smaller team, and the new
    ones would inherit the master's one core. A user's OpenMP placement wins."""
    from splitserve.engine import openmp
    for v in openmp.PLACEMENT_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(openmp.os, "sched_getaffinity", lambda pid: {2, 5})
    assert openmp.team_cores(2) == [2, 5]
    assert openmp.team_cores(1) == [] and openmp.team_cores(3) == []
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert openmp.team_cores(2) == []
    monkeypatch.delenv("OMP_PROC_BIND")
    monkeypatch.setattr(openmp.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert openmp.team_cores(4) == []
