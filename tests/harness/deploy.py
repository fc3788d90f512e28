"""What the deployment tests share (compose.yaml, deploy/kubernetes): a container's command line and
environment, read by splitserve's own CLI parser, as the process in the container will read them."""
from __future__ import annotations

import argparse
import contextlib
import os

# Read by every process, but not flags (logging is set up before the CLI parses).
NOT_FLAGS = frozenset({"SPLITSERVE_LOG_LEVEL", "SPLITSERVE_LOG_FORMAT"})


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ holding exactly ``values`` as SPLITSERVE_* (the CLI reads them while building its parser)."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
        del os.environ[key]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_container(argv: list[str], env: dict[str, str], where: str = "") -> argparse.Namespace:
    """The arguments ``splitserve <argv>`` runs with in a container whose environment is ``env``.

    Raises click's usage errors on a bad flag or value (click checks the variables' values against
    types and choices too), and AssertionError when a ``SPLITSERVE_*`` variable names no flag of
    that command: a typo would otherwise be ignored in silence."""
    from splitserve.cli.commands import parse
    from splitserve.cli.flags import FLAGS
    with environment(env):
        args = parse(list(argv))
    known = {f.envvar for f in FLAGS if argv[0] in f.kinds} | NOT_FLAGS
    unknown = sorted(k for k in env if k.startswith("SPLITSERVE_") and k not in known)
    if unknown:
        raise AssertionError(f"{where}: no flag of `splitserve {argv[0]}` reads {unknown}")
    return args
