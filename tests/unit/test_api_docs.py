"""docs/api.md is built from the protos' comments (scripts/gen_api_docs.py), and every
element of the contract has a comment: this fails on drift or on a missing comment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_docs_match_the_protos_and_every_element_is_commented() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
