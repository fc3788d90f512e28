"""The per-file seconds that order the suite's files (tests/harness/file_seconds.py)."""
import json

from tests.harness import file_seconds

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
 <testcase classname="tests.faults.test_faults" name="test_a" time="12.5"/>
 <testcase classname="tests.faults.test_faults" name="test_b" time="0.25"/>
 <testcase classname="tests.test_sampler" name="test_c[1]" time="0.125"><skipped message="no"/></testcase>
 <testcase classname="" name="collection error" time="3"/>
</testsuite></testsuites>
"""


def test_seconds_are_summed_by_file(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    assert file_seconds.from_junit(junit) == {"tests/faults/test_faults.py": 12.8, "tests/test_sampler.py": 0.1}


def test_main_writes_the_record_and_load_reads_it_back(tmp_path, monkeypatch):
    junit, record = tmp_path / "junit.xml", tmp_path / "file_seconds.json"
    junit.write_text(JUNIT)
    monkeypatch.setattr(file_seconds, "RECORD", record)
    file_seconds.main([str(junit)])
    assert json.loads(record.read_text()) == file_seconds.load() == file_seconds.from_junit(junit)
    record.write_text("{not json")
    assert file_seconds.load() == {}  # an unreadable record orders nothing; it fails nothing


def test_the_committed_record_is_of_a_whole_suite_run():
    seconds = file_seconds.load()
    assert sum(seconds.values()) > 600, "tests/file_seconds.json is missing or nearly empty"
    assert all(name.startswith("tests/") and name.endswith(".py") for name in seconds)
