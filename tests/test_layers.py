"""The layers are a checked contract (import-linter, ``[tool.importlinter]`` in pyproject.toml):
``common <- engine <- kvtransfer <- {state, wire} <- {gateway, worker, client} <- cli``, no import
circles, and no torch in the gateway. The tree keeps them, and a planted violation of each fails."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_tree_keeps_every_contract():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """The package and its contracts in a scratch directory, to plant violations in."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "splitserve", root / "splitserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize("module, line, broken", [
    # the engine reaching up into the gateway (also inside a function: grimp sees those too)
    ("engine/config.py", "def _up():\n    from splitserve.gateway import servicer\n", "layers import only downward"),
    # the common base reaching up into the engine
    ("common/errors.py", "import splitserve.engine.scheduler\n", "layers import only downward"),
    # two sibling modules importing each other
    ("engine/kv_sizes.py", "from splitserve.engine import priority\n", "no import circles"),
    # torch in the gateway
    ("gateway/outbox.py", "import torch\n", "never imports torch"),
])
def test_a_planted_violation_breaks_its_contract(copy, module, line, broken):
    path = copy / "splitserve" / module
    original = path.read_text()
    if module == "engine/kv_sizes.py":  # the other half of the circle
        priority = copy / "splitserve" / "engine" / "priority.py"
        priority_original = priority.read_text()
        priority.write_text(priority_original + "\nfrom splitserve.engine import kv_sizes\n")
    path.write_text(original + "\n" + line)
    try:
        out = lint(copy)
    finally:
        path.write_text(original)
        if module == "engine/kv_sizes.py":
            priority.write_text(priority_original)
    assert out.returncode != 0
    assert "Broken contracts" in out.stdout and broken in out.stdout.split("Broken contracts", 1)[1], out.stdout[-4000:]
