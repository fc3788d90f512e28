"""bench/vllm_bench_serve.py: the parts that run without vLLM. Whose CPU time is whose, on a real
process tree (a parent, a named child that burns CPU, and that child's own child)."""
import os
import signal
import subprocess
import sys

from bench.vllm_bench_serve import breakdown, client_command, cpu_by_process, cpu_flags, per_request

# The root starts a child which starts a grandchild; the grandchild spins for `BURN_S` of CPU
# then all three sleep until killed. Each prints its pid so the test can name them.
BURN_S = 0.6
TREE = f"""
import os, subprocess, sys, time
depth = int(sys.argv[1])
if depth < 2:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth + 1), sys.argv[2]])
print(os.getpid(), flush=True)
if depth == 2:
    end = time.process_time() + {BURN_S}
    while time.process_time() < end:
        pass
    print("burnt", flush=True)
time.sleep(60)
"""


def stat_of(pid: int) -> tuple[str, int]:
    """A process's command name and parent pid."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.index("(") + 1:stat.rindex(")")], int(stat.rsplit(")", 1)[1].split()[1])


def test_cpu_time_goes_to_the_nearest_named_ancestor():
    root = subprocess.Popen([sys.executable, "-c", TREE, "0", TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        lines = [root.stdout.readline().strip() for _ in range(4)]  # three pids and "burnt", in any order
        assert "burnt" in lines
        pids = [int(line) for line in lines if line != "burnt"]
        others = [p for p in pids if p != root.pid]
        child = next(p for p in others if stat_of(p)[1] == root.pid)
        grandchild = next(p for p in others if p != child)

        named = cpu_by_process(root.pid, {root.pid: "root", child: "worker"})
        assert set(named) == {"root", "worker"}
        assert named["worker"] >= BURN_S * 0.9  # the grandchild's spin, under its named parent
        assert named["root"] < BURN_S / 2

        # Naming the grandchild moves its time to it; an unnamed child of the root goes by its command.
        split = cpu_by_process(root.pid, {root.pid: "root", grandchild: "spinner"})
        assert split["spinner"] >= BURN_S * 0.9
        assert set(split) == {"root", "spinner", stat_of(child)[0]}
        assert split[stat_of(child)[0]] < BURN_S / 2
    finally:
        os.killpg(root.pid, signal.SIGKILL)  # the whole tree: it runs in its own session
        root.wait()


def test_cpu_flags_are_read_from_this_machine():
    with open("/proc/cpuinfo") as f:
        text = f.read()
    flags = cpu_flags()
    assert flags, "no vector flag at all on an x86-64 box that runs torch"
    for flag in flags:
        assert f" {flag}" in text


def test_breakdown_is_what_one_run_added_to_the_counters():
    before = {"gateway": {"vllm:request_queue_time_seconds_sum": 1.0, "vllm:request_queue_time_seconds_count": 10},
              "both": {"splitserve:engine_steps_total": 100, "splitserve:engine_step_seconds_total{phase=forward}": 2.0,
                       "splitserve:engine_step_seconds_total{phase=schedule}": 0.1}}
    after = {"gateway": {"vllm:request_queue_time_seconds_sum": 1.5, "vllm:request_queue_time_seconds_count": 20},
             "both": {"splitserve:engine_steps_total": 300, "splitserve:engine_step_seconds_total{phase=forward}": 6.0,
                      "splitserve:engine_step_seconds_total{phase=schedule}": 0.3}}
    # vLLM's API server labels its series by engine: each span is summed over the label sets.
    before["api_server"] = {"vllm:time_to_first_token_seconds_sum{engine=0}": 1.0,
                            "vllm:time_to_first_token_seconds_count{engine=0}": 4,
                            "vllm:time_to_first_token_seconds_sum{engine=1}": 0.0,
                            "vllm:time_to_first_token_seconds_count{engine=1}": 0}
    after["api_server"] = {"vllm:time_to_first_token_seconds_sum{engine=0}": 2.0,
                           "vllm:time_to_first_token_seconds_count{engine=0}": 8,
                           "vllm:time_to_first_token_seconds_sum{engine=1}": 1.0,
                           "vllm:time_to_first_token_seconds_count{engine=1}": 6}
    out = breakdown(before, after)
    assert out["gateway"] == {"queued": 50.0}  # 0.5 s over 10 requests; spans without requests left out
    assert out["api_server"] == {"ttft_at_server": 200.0}  # 2 s over 10 requests
    assert out["both"] == {"steps": 200, "ms_per_step": {"forward": 20.0, "schedule": 1.0}}


def test_each_request_is_kept_in_the_order_sent_with_its_start_from_the_runs_first():
    # What `vllm bench serve --save-detailed` writes: seconds, the requests in the order sent.
    saved = {"input_lens": [250, 36, 120], "start_times": [1000.5, 1000.25, 1001.75], "ttfts": [0.0812, 0.04, 0.1]}
    assert per_request(saved) == {"input_len": [250, 36, 120], "start_s": [0.25, 0.0, 1.5],
                                  "ttft_ms": [81.2, 40.0, 100.0]}
    assert per_request({}) == {"input_len": [], "start_s": [], "ttft_ms": []}  # a client that saved none
    failed = {**saved, "ttfts": [0.0812, 0.0, 0.1], "errors": ["", "Internal Server Error", ""]}
    assert per_request(failed)["ttft_ms"] == [81.2, None, 100.0]  # not a 0 ms first token


def test_the_client_is_asked_for_each_requests_figures():
    class Args:
        peer_python, input_len, output_len, range_ratio = "python", 144, 64, 0.75
    command = client_command(Args, "http://h:1", "m", "/tok", "2", 64, "/results", "run", 7)
    assert "--save-detailed" in command and command[command.index("--result-filename") + 1] == "run.json"
