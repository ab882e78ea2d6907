"""docs/api.md is built from the protos' comments (scripts/gen_api_docs.py), and every
element of the contract has a comment: this fails on drift or on a missing comment."""

from __future__ import annotations

from tests.helpers import script_check


def test_api_docs_match_the_protos_and_every_element_is_commented() -> None:
    proc = script_check("gen_api_docs.py")
    assert proc.returncode == 0, proc.stderr
