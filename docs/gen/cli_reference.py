"""The flag reference of docs/configuration.md, generated from the CLI when the site is built
(mkdocs-gen-files).

It builds the click group the ``splitserve`` command runs (``splitserve.cli.commands.build()``)
and writes one table per subcommand: every option with its type, default, environment variable
and help, as ``--help`` shows them. The result replaces the marker line in docs/configuration.md,
so the page cannot drift from the code: change a flag's help where the flag is declared
(``splitserve/cli/flags.py``, the engine's config dataclass, ``splitserve/cli/commands.py``).

    python docs/gen/cli_reference.py      # prints the generated Markdown
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

import click  # noqa: E402

from markdown_text import inline, one_line  # noqa: E402

PAGE = "configuration.md"
MARKER = "<!-- generated: CLI reference -->"
ORDER = ("decode", "prefill", "gateway", "up", "tune", "generate")


def flag_names(param: click.Option) -> str:
    names = [*param.opts, *param.secondary_opts]
    text = " / ".join(f"`{n}`" for n in names)
    if param.is_flag:
        return text
    if isinstance(param.type, click.Choice):
        return f"{text} {{{', '.join(f'`{c}`' for c in param.type.choices)}}}"
    metavar = param.metavar or param.type.name.upper()
    return f"{text} {inline(metavar)}"


def default(param: click.Option, ctx: click.Context) -> str:
    if param.required:
        return "required"
    if not param.show_default and not param.is_flag and param.default not in (None, "", 0, False):
        return "(not shown)"
    value = param.get_default(ctx, call=True)
    if param.is_flag and not param.secondary_opts:
        return "on" if value else "off"
    if param.secondary_opts:  # --x/--no-x
        return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
    if value is None or value == "":
        return "—"
    return f"`{value}`"


def envvar(param: click.Option) -> str:
    names = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar] if param.envvar else []
    return ", ".join(f"`{n}`" for n in names) or "—"


def options_table(params: list[click.Parameter], ctx: click.Context) -> list[str]:
    rows = ["| flag | default | environment | what it does |", "|---|---|---|---|"]
    for param in params:
        if isinstance(param, click.Option) and not param.hidden:
            rows.append(f"| {flag_names(param)} | {default(param, ctx)} | {envvar(param)} | "
                        f"{one_line(param.help or '')} |")
    return rows


def render() -> str:
    from splitserve.cli.commands import build

    group = build()
    root = click.Context(group, info_name="splitserve")
    out = ["<!-- Generated from splitserve.cli.commands.build() by docs/gen/cli_reference.py when the site "
           "is built. -->", "",
           "### Options of every command", "",
           "Given before the subcommand (`splitserve --log-format json up ...`) or through the environment.", ""]
    out += options_table(group.params, root) + [""]
    for name in sorted(group.commands, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        command = group.commands[name]
        ctx = click.Context(command, info_name=name, parent=root)
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        usage = " ".join(["splitserve", name, "[OPTIONS]", *(p.name.upper() for p in arguments)])
        out += [f"### `splitserve {name}`", "", inline(command.help or ""), "", "```text", usage, "```", ""]
        for argument in arguments:
            out += [f"Argument `{argument.name.upper()}`{' (required)' if argument.required else ''}.", ""]
        out += options_table(command.params, ctx) + [""]
    return "\n".join(out)


def main() -> None:
    import mkdocs_gen_files
    with mkdocs_gen_files.open(PAGE, "r+") as page:
        text = page.read()
        if MARKER not in text:
            raise SystemExit(f"docs/{PAGE} has no line {MARKER!r} to put the flag reference at")
        page.seek(0)
        page.write(text.replace(MARKER, render()))
        page.truncate()


if __name__ == "__main__":
    print(render())
else:  # run by mkdocs-gen-files
    main()
