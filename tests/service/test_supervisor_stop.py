"""``up`` stops its children stage by stage: the gateway, then the workers, then Redis, each stage
only once the one before has gone (a draining gateway or worker still talks to Redis)."""
import sys

from splitserve.cli.launcher import ChildSpec, Supervisor

# A child that prints its ready line, and on SIGTERM notes when it got it, drains for a moment
# and notes when it leaves (monotonic clock times, comparable across processes on one host).
CHILD = """
import signal, sys, time
log = sys.argv[1]
def term(*_):
    with open(log, "a") as f:
        f.write(f"term {time.monotonic()}\\n")
    time.sleep(0.3)
    with open(log, "a") as f:
        f.write(f"exit {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_each_stage_gets_sigterm_only_after_the_one_before_has_exited(tmp_path):
    names = ["gateway", "decode0", "prefill0", "redis"]
    logs = {n: tmp_path / f"{n}.log" for n in names}
    supervisor = Supervisor([ChildSpec(n, [sys.executable, "-c", CHILD, str(logs[n])], "ready") for n in names],
                            say=lambda text: None)
    supervisor.boot(names)
    supervisor.stop([["gateway"], ["decode0", "prefill0"], ["redis"]])

    def times(name):
        return dict(line.split() for line in logs[name].read_text().splitlines())
    at = {n: {k: float(v) for k, v in times(n).items()} for n in names}
    assert all(supervisor.child(n).proc.returncode == 0 for n in names)  # drained, not killed
    assert at["decode0"]["term"] > at["gateway"]["exit"] and at["prefill0"]["term"] > at["gateway"]["exit"]
    assert at["redis"]["term"] > max(at["decode0"]["exit"], at["prefill0"]["exit"])
    # The workers of one stage stop together: the second got SIGTERM before the first had left.
    assert max(at["decode0"]["term"], at["prefill0"]["term"]) < min(at["decode0"]["exit"], at["prefill0"]["exit"])
