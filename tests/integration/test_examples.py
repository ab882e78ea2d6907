"""The examples run as written (fewer steps): an example that no longer runs is a bug."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (its ``main`` not yet run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_async_grpo_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TREADLE_ADDRESS", raising=False)  # its own embedded server
    example = _load("async_grpo")
    example.STEPS = 3  # its warm-up, server and loop as written, three steps of it
    example.main()
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]  # step, version, reward, tokens, ...
    assert all(0.0 <= float(r[2]) <= 1.0 for r in rows)


def test_sweep_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("TREADLE_ADDRESS", raising=False)  # its own embedded servers
    example = _load("sweep")
    # its warm-up, export, servers and sweep as written, smaller
    example.LRS, example.STEPS, example.GROUPS_PER_STEP = (1e-3, 1e-2), 2, 4
    example.WARMUP_MAX_STEPS = 10
    example.OUT = tmp_path / "sweep.png"
    example.main()
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2]  # step, then each run's reward
    assert all(len(r) == 3 and all(0.0 <= float(x) <= 1.0 for x in r[1:]) for r in rows)
    assert "lr=0.001: reward" in out and "lr=0.01: reward" in out
    assert "training passes on demo-warm:" in out
    assert example.OUT.stat().st_size > 0


@pytest.mark.slow
def test_agent_calculator_example_learns_to_use_its_tool(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example as written (warm-up, GRPO over episodes, evaluation on fixed
    problems and seeds): both the success rate and the share of episodes that
    call the calculator correctly rise."""
    monkeypatch.delenv("TREADLE_ADDRESS", raising=False)  # its own embedded server
    example = _load("agent_calculator")
    success0, success1, calls0, calls1 = example.main()
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, example.STEPS + 1))
    assert all(r[5] == "0" for r in rows)  # no episode failed
    assert calls1 >= calls0 + 0.15, (calls0, calls1)
    assert success1 >= success0 + 0.1, (success0, success1)
