"""The vLLM adapter directories: made when an adapter is first written, gone after
``close`` (an engine closed and restarted, or shut down, leaves nothing in /tmp)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from treadle.workers.model import LoraAdapter, ModelConfig
from treadle.workers.vllm.adapters import AdapterRegistry

CFG = ModelConfig(
    arch="llama",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where temporary directories are made during the test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_registry_that_wrote_nothing_leaves_no_directory(tmp: Path) -> None:
    registry = AdapterRegistry("base")
    assert list(tmp.iterdir()) == []
    registry.close()
    assert list(tmp.iterdir()) == []


def test_written_adapters_live_under_one_directory_that_close_removes(tmp: Path) -> None:
    registry = AdapterRegistry("base")
    adapter = LoraAdapter(CFG, 2, 4.0, seed=0, requires_grad=False)
    first = registry.adapter_for("m-1", 1, adapter)
    assert registry.adapter_for("m-1", 1, adapter) is first  # written once
    assert (first.path / "adapter_config.json").exists()
    (made,) = tmp.iterdir()
    assert made.name.startswith("treadle-vllm-lora-") and first.path.parent == made
    registry.close()
    assert list(tmp.iterdir()) == []
