"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link or anchor fails),
the README stays a front page, and the two generated references cover the code they come from:
every flag of every ``splitserve`` command is on the configuration page, every RPC and message of
the public gRPC API on the API page. mkdocs is a test dependency (the ``docs`` extra): without it
these tests fail rather than skip."""
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    assert importlib.util.find_spec("mkdocs") is not None, \
        "mkdocs is not installed: pip install -e '.[docs]' (make test installs it)"
    out = tmp_path_factory.mktemp("site")
    # mkdocs-material and mkdocs print banners about MkDocs 2; they say nothing about this site.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_site_builds_strict(site):
    for name in ("architecture", "api", "configuration", "deploy", "performance", "contributing"):
        assert (site / name / "index.html").exists(), name


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: keep it a front page; details go to docs/"
    assert "make run" in text and "make test" in text


def test_configuration_page_lists_every_flag_of_every_command(site):
    from splitserve.cli.commands import build

    text = page(site, "configuration")
    group = build()
    missing = []
    for command_name, command in [("", group), *group.commands.items()]:
        if command_name:
            assert f"<code>splitserve {command_name}</code>" in text, command_name
        for param in command.params:
            if isinstance(param, click.Option):
                missing += [f"{command_name or 'splitserve'} {opt}" for opt in [*param.opts, *param.secondary_opts]
                            if opt.startswith("--") and f"<code>{html.escape(opt)}</code>" not in text]
    assert not missing, f"flags missing from the configuration page: {missing}"


def test_api_page_names_every_rpc_and_message_of_the_public_service(site):
    from splitserve.v1 import generation_pb2

    text = page(site, "api")
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.methods
    missing = [m.name for m in service.methods if f"<td><code>{m.name}</code></td>" not in text]
    assert not missing, f"RPCs of splitserve.v1.Generation missing from the API page: {missing}"
    ids = set(re.findall(r'id="([^"]+)"', text))
    messages = [m.full_name for m in generation_pb2.DESCRIPTOR.message_types_by_name.values()]
    missing = [m for m in messages if m.lower().replace(".", "-") not in ids]
    assert not missing, f"messages missing from the API page: {missing}"


def test_models_page_lists_every_served_and_refused_architecture(site):
    from splitserve.engine.model_registry import REFUSED, SUPPORTED

    text = page(site, "models")
    missing = [name for name in [*SUPPORTED, *REFUSED] if f"<code>{name}</code>" not in text]
    assert not missing, f"architectures missing from the models page: {missing}"
