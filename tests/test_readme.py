"""The README stays a user's page: at most 150 lines, and every file it links to exists."""

from __future__ import annotations

import re

from tests.worker.conftest import ROOT


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README is for users (<= 150 lines): move detail to docs/*.md"
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target
