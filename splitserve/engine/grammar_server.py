"""``python -m splitserve.engine.grammar_server``: checks structured-output specs for a process that
must not load the grammar library itself (the gateway: xgrammar loads torch; a deep schema can
compile for seconds, which must not stop its event loop).

One JSON document a line on stdin, ``{"id": 7, "kind": "regex", "value": "[0-9]+"}``
(``kind`` and ``value`` as ``StructuredOutput`` holds them; a choice's value is a list); one
answer a line on stdout, ``{"id": 7, "error": null}`` or the message ``check_grammar`` gives.
Nothing is unpickled: JSON only. It exits when stdin closes.
"""
from __future__ import annotations

import json
import sys

from splitserve.engine.grammar import check_grammar
from splitserve.engine.structured_output import KINDS, StructuredOutput


def answer(line: str) -> dict:
    request = json.loads(line)
    kind, value = request["kind"], request["value"]
    if kind not in KINDS:
        return {"id": request["id"], "error": f"structured_output: unknown kind {kind!r}"}
    try:
        check_grammar(StructuredOutput(**{kind: tuple(value) if kind == "choice" else value}))
        return {"id": request["id"], "error": None}
    except ValueError as e:
        return {"id": request["id"], "error": str(e)}


def main() -> int:
    import xgrammar  # noqa: F401 (loaded before the first request, not during it)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(answer(line)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
