"""tests/file_seconds.json, the order `make test` starts files in: read from junit, and naming only files that exist."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.file_seconds import FILE_SECONDS, TESTS, seconds_by_file

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.core.test_spmd" name="test_a[full]" time="14.5" />
<testcase classname="tests.core.test_spmd" name="test_b" time="0.5" />
<testcase classname="tests.api.test_jobs.TestJobs" name="test_c" time="2.25" />
<testcase classname="tests.test_readme" name="test_d" time="0.04" />
</testsuite></testsuites>"""


def test_seconds_are_summed_per_file_longest_first(tmp_path: Path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    got = seconds_by_file(junit)
    assert got == {"core/test_spmd.py": 15.0, "api/test_jobs.py": 2.2, "test_readme.py": 0.0}
    assert list(got) == ["core/test_spmd.py", "api/test_jobs.py", "test_readme.py"]


def test_every_file_named_exists():
    """A renamed or deleted file would leave a stale entry (and its successor would start at the median)."""
    names = json.loads(FILE_SECONDS.read_text())
    assert names and [name for name in names if not (TESTS / name).is_file()] == []
