"""Seconds each test file took in a whole-suite run, to hand the longest files out first.

``make test`` runs the suite in two processes, a file to each at a time (``-n 2 --dist loadfile``).
The files are handed out in the order of the collection, so a long file taken last leaves the
other process idle while it ends. ``tests/conftest.py`` orders the files by the seconds recorded
here, the longest first (the classic longest-processing-time rule), and files not recorded by
whether they start processes.

Refresh after a whole-suite run that wrote JUnit XML (``--junitxml``):

    python -m tests.harness.file_seconds /path/to/junit.xml

Stale figures cost only balance: the order changes, never which tests run.
"""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "file_seconds.json"


def from_junit(path: str | Path) -> dict[str, float]:
    """{tests/... .py: seconds} from a JUnit XML file: every test case's time (setup, call and
    teardown; a module fixture's start-up counts in its first test), summed by file."""
    seconds: dict[str, float] = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        if module.startswith("tests."):
            seconds[module.replace(".", "/") + ".py"] += float(case.get("time") or 0.0)
    return {name: round(value, 1) for name, value in sorted(seconds.items())}


def load() -> dict[str, float]:
    """The recorded seconds, or nothing where the record is missing or unreadable."""
    try:
        return json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m tests.harness.file_seconds JUNIT_XML")
    seconds = from_junit(argv[0])
    RECORD.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s in all -> {RECORD}")


if __name__ == "__main__":
    main(sys.argv[1:])
