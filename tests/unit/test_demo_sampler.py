"""``treadle demo --sampler``: the demo trains a full fine-tune, which the vllm
backend does not serve, so it stops before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.server.demo import DemoOptions, run_demo


def test_demo_on_vllm_stops_at_once_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_demo(DemoOptions(data_dir=tmp_path, sampler="vllm")) == 2
    assert "full fine-tune" in capsys.readouterr().err
    assert not (tmp_path / "server").exists()  # nothing started
