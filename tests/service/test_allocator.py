"""Engine processes run on tcmalloc where it is installed (splitserve/cli/allocator.py)."""
import os
import subprocess
import sys

import pytest

from splitserve.cli.allocator import ALLOCATOR_ENV, env_with_tcmalloc, tcmalloc_library

LIBRARY = "/usr/lib/libtcmalloc_minimal.so.4"


def test_the_library_goes_first_in_ld_preload_and_what_was_there_stays():
    env = env_with_tcmalloc({"PATH": "/bin", "LD_PRELOAD": "/opt/libother.so"}, LIBRARY)
    assert env["LD_PRELOAD"] == f"{LIBRARY}:/opt/libother.so"
    assert env["PATH"] == "/bin"
    assert env_with_tcmalloc({}, LIBRARY)["LD_PRELOAD"] == LIBRARY


@pytest.mark.parametrize("env, library", [
    ({}, None),  # not installed
    ({ALLOCATOR_ENV: "system"}, LIBRARY),  # the user's choice
    ({"LD_PRELOAD": "/opt/libtcmalloc.so.4"}, LIBRARY),  # already preloaded (say by a container image)
])
def test_nothing_changes(env, library):
    assert env_with_tcmalloc(env, library) is None


def test_a_user_threshold_for_large_allocation_reports_stays():
    env = env_with_tcmalloc({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, LIBRARY)
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"


RESTART = ("import os, sys\n"
           "from splitserve.cli.allocator import restart_with_tcmalloc, preloaded\n"
           "restart_with_tcmalloc()\n"
           "print(os.getpid(), preloaded(), sys.argv[1:])\n")


def _run(extra_env: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ALLOCATOR_ENV)}
    done = subprocess.run([sys.executable, "-c", RESTART, "a", "--b"], env={**env, **extra_env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(None, 2)


def test_a_process_restarts_itself_on_tcmalloc_with_its_arguments():
    assert tcmalloc_library(), "tcmalloc is not installed: `make tcmalloc` (apt libtcmalloc-minimal4)"
    _pid, on_tcmalloc, argv = _run({})
    assert on_tcmalloc == "True" and argv.strip() == "['a', '--b']"
    assert _run({ALLOCATOR_ENV: "system"})[1] == "False"
