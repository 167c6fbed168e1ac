"""Write tests/file_seconds.json (seconds per test file) from a pytest junit XML: the order `make test` starts files in.

Run after a full ``pytest --junitxml=PATH`` on the machine kind CI uses: ``python -m tests.support.file_seconds PATH``.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FILE_SECONDS = TESTS / "file_seconds.json"


def seconds_by_file(junit: Path) -> dict[str, float]:
    """Each test file's summed test time (setup, call and teardown, as junit reports it), keyed as under tests/."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname is the dotted module path ("tests.core.test_spmd"), plus a class for methods.
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if len(parts) > 1 and parts[0] == "tests":
            totals["/".join(parts[1:]) + ".py"] += float(case.get("time", 0.0))
    return {name: round(s, 1) for name, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    times = seconds_by_file(Path(sys.argv[1]))
    FILE_SECONDS.write_text(json.dumps(times, indent=1) + "\n")
    print(f"{len(times)} files, {sum(times.values()):.0f} s -> {FILE_SECONDS}")


if __name__ == "__main__":
    main()
