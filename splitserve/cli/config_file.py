"""``--config FILE``: flag values from a YAML (or JSON) file, for every ``splitserve`` command.

One file serves the whole stack: its keys are flag names (``max_num_seqs`` or ``max-num-seqs``),
and each process reads the keys it takes and passes over the ones meant for others (a
gateway skips ``max_num_seqs``; ``up`` takes ``prefill`` and ``decode``). A key that no
command takes is an error naming the file and the nearest flag, as a typo should be.
``splitserve tune`` writes such a file.

Precedence, highest first: the command line, ``SPLITSERVE_*`` environment variables, the
file, the built-in default. The file fills click's ``default_map`` before any other flag is
read, which gives exactly that order.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path

import click

ENVVAR = "SPLITSERVE_CONFIG"


def read(path: str | Path) -> dict:
    """The file's flag values, keys in python form (``max_num_seqs``). Raises ``click.BadParameter``."""
    import yaml

    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as e:
        raise click.BadParameter(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of flag names to values, got {type(data).__name__}")
    values = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise click.BadParameter(f"{path}: key {key!r} is not a flag name")
        if isinstance(value, (dict, list)):
            raise click.BadParameter(f"{path}: {key} must be a single value, got {json.dumps(value)}")
        values[key.replace("-", "_")] = value
    return values


def known_names(group: click.Group) -> set[str]:
    """Every name a config file may set: the flags of every command of ``group`` that takes one."""
    names: set[str] = set()
    for command in group.commands.values():
        names |= {p.name for p in command.params if isinstance(p, click.Option) and p.name != "config"}
    return names


def option() -> click.Option:
    """The ``--config`` option: read before every other flag, it makes the file's values their defaults."""
    def load(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
        if not path:
            return path
        values = read(path)
        known = known_names(ctx.find_root().command)  # the `splitserve` group: every command
        for key in values:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise click.BadParameter(f"{path}: no splitserve flag is called {key}{hint}")
        mine = {p.name for p in ctx.command.params}
        ctx.default_map = {**(ctx.default_map or {}), **{k: v for k, v in values.items() if k in mine}}
        return path

    return click.Option(["--config", "config"], type=click.Path(exists=True, dir_okay=False), default=None,
                        envvar=ENVVAR, show_envvar=True, is_eager=True, expose_value=True, callback=load,
                        help="YAML file of flag values (keys: flag names; `splitserve tune` writes one); the "
                             "command line and SPLITSERVE_* variables override it")


def dump(values: dict, header: str = "") -> str:
    """YAML text of ``values`` (flag names with dashes), with ``header`` as leading comments."""
    import yaml

    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.safe_dump({k.replace("_", "-"): v for k, v in values.items()}, sort_keys=False)
    return comments + body
