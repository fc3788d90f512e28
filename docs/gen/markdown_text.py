"""Turning comments and help strings into Markdown that renders as written (shared by the page generators)."""
from __future__ import annotations

import html
import re

_CODE = re.compile(r"(``.+?``|`[^`]+`)")


def inline(text: str) -> str:
    """Plain text -> Markdown: code spans (`x` or ``x``) kept, everything else escaped, so a
    comment's `>`, `<`, `*` or `|` shows as itself (also inside a table cell)."""
    out = []
    for i, part in enumerate(_CODE.split(text)):
        if i % 2:  # a code span: only its pipes need escaping, for tables
            out.append(part.replace("|", "\\|"))
        else:
            part = html.escape(part, quote=False)
            out.append(re.sub(r"([*_|\[\]\\])", r"\\\1", part))
    return "".join(out)


def one_line(text: str) -> str:
    """A comment as one table cell."""
    return inline(" ".join(text.split()))


def paragraphs(comment: str) -> str:
    """A multi-line comment as Markdown: plain lines flow into paragraphs, indented lines (examples,
    numbered steps) stay as they are in a literal block."""
    blocks, prose, literal = [], [], []

    def flush_prose():
        if prose:
            blocks.append(inline(" ".join(line.strip() for line in prose)))
            prose.clear()

    def flush_literal():
        if literal:
            blocks.append("```text\n" + "\n".join(literal) + "\n```")
            literal.clear()

    for line in comment.splitlines():
        if not line.strip():
            flush_prose()
            flush_literal()
        elif line.startswith((" ", "\t")):
            flush_prose()
            literal.append(line.rstrip())
        else:
            flush_literal()
            prose.append(line)
    flush_prose()
    flush_literal()
    return "\n\n".join(blocks)
