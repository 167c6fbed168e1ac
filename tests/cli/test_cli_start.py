"""Every `gspo` command builds the whole command parser first: that must not import torch."""

from __future__ import annotations

import subprocess
import sys

from tests.embedded_service import ROOT


def test_building_the_command_parser_imports_no_torch():
    """`gspo models`' parser took its default tolerance from the importer, which brought torch into every `gspo`
    command (2.2 s for `gspo --help` on a 2-core EPYC, 0.36 s without)."""
    probe = "import sys; from gspo_cli.main import build_parser; build_parser(); "
    probe += "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
