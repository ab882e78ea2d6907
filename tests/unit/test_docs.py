"""The user's docs: what they cite exists, what they show matches the code.

A user has the README, docs/, the SDK's docstrings and the CLI's help, not
the project's internal notes: nothing there may cite a design file, an issue
number or the project's seed document. Links between the docs resolve, and
the loop signatures docs/async_rl.md shows are the code's.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from treadle import rl

ROOT = Path(__file__).resolve().parents[2]
USER_FACING = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted(p for p in (ROOT / "client_sdk").rglob("*.py") if "v1" not in p.parts),
    ROOT / "server" / "cli.py",
    ROOT / "server" / "config.py",
    ROOT / "server" / "demo.py",
    *sorted((ROOT / "examples").glob("*.py")),
]
LEAKS = {
    "a design file the user does not have": r"DESIGN\.md",
    "an issue number": r"\bissue \d+|\bthe issue's\b",
    "the project's seed document": r"\bthe seed's\b|\bseed \"",
}


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_references(path: Path) -> None:
    text = path.read_text()
    for what, pattern in LEAKS.items():
        hits = [m.group(0) for m in re.finditer(pattern, text)]
        assert not hits, f"{path.relative_to(ROOT)} cites {what}: {hits}"


def _links(path: Path) -> list[str]:
    return [
        m.group(1).split("#", 1)[0]
        for m in re.finditer(r"\]\(([^)\s]+)\)", path.read_text())
        if not re.match(r"[a-z]+:", m.group(1)) and not m.group(1).startswith("#")
    ]


def test_links_between_the_docs_resolve() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for doc in docs:
        for link in _links(doc):
            target = (doc.parent / link).resolve()
            assert target.exists(), f"{doc.relative_to(ROOT)} links to {link}"


def test_the_readme_lists_the_user_guides() -> None:
    readme = (ROOT / "README.md").read_text()
    docs_list = readme.split("## Docs", 1)[1].split("\n## ", 1)[0]
    for guide in (
        "concepts.md",
        "rl_loop.md",
        "losses.md",
        "async_rl.md",
        "lora.md",
        "restarts.md",
        "agents.md",
    ):
        assert f"docs/{guide}" in docs_list, guide


def _documented_signatures() -> dict[str, inspect.Signature]:
    """The ``name(params) -> ...`` lines of docs/async_rl.md's signature block, as
    signatures (the names, kinds and defaults; annotations are not shown there)."""
    text = (ROOT / "docs" / "async_rl.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "async_loop(" in b)
    out = {}
    for name, params in re.findall(r"^(\w+)\((.*?)\) ->", block, re.S | re.M):
        namespace: dict[str, Any] = {}
        exec(f"def {name}({' '.join(params.split())}): pass", namespace)
        out[name] = inspect.signature(namespace[name])
    return out


def _shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_async_rl_md_shows_the_loops_signatures() -> None:
    documented = _documented_signatures()
    assert set(documented) == {"sync_loop", "one_step_stale_loop", "async_loop", "grpo_train_step"}
    for name, sig in documented.items():
        assert _shape(sig) == _shape(inspect.signature(getattr(rl, name))), name
