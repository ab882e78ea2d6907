"""A published version kept as a file (``workers.model.published.WeightsFile``, what
vLLM reloads from): written one tensor at a time, read back equal, removed with its
last holder, and a killed process's versions removed by the next one to start."""

from __future__ import annotations

import gc
import subprocess
from pathlib import Path

import torch

from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.model.loading import load_checkpoint
from treadle.workers.model.published import WeightsFile, WholeWeights, remove_orphans
from treadle.workers.model.streamed_file import Entry


def _whole(params_dir: Path) -> tuple[WholeWeights, dict[str, torch.Tensor]]:
    base = BaseModelRegistry({"tiny": params_dir}).get("tiny", torch.float64)
    named = dict(base.weights_copy().named_tensors())
    entries = tuple(Entry.of(n, t) for n, t in named.items())
    whole = WholeWeights("m/1", 3, base.cfg, entries, iter(named.items()), torch.device("cpu"))
    return whole, named


def test_a_version_file_reads_back_and_goes_with_its_last_holder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    whole, named = _whole(tiny_model_dir)
    kept = WeightsFile.write(whole, tmp_path)
    directory = kept.directory
    assert directory.parent == tmp_path and "-m_1-v3-" in directory.name
    assert kept.nbytes >= whole.nbytes
    cfg, params = load_checkpoint(directory, dtype=torch.float64)  # a checkpoint vLLM reads
    assert cfg == whole.cfg
    for (name, t), want in zip(kept.read().named_tensors(), named.values(), strict=True):
        assert torch.equal(t, want), name
    assert params.dtype == kept.dtype == torch.float64
    del kept
    gc.collect()
    assert not directory.exists()


def test_a_killed_process_versions_are_removed(tiny_model_dir: Path, tmp_path: Path) -> None:
    whole, _ = _whole(tiny_model_dir)
    mine = WeightsFile.write(whole, tmp_path)
    exited = subprocess.Popen(["true"])  # a process that is gone (a killed worker)
    exited.wait()
    orphan = tmp_path / f"treadle-version-{exited.pid}-m-v1-abc"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"x")
    other = tmp_path / "treadle-other"  # not a version directory: left alone
    other.mkdir()
    assert remove_orphans(tmp_path) == [orphan]
    assert not orphan.exists() and mine.directory.exists() and other.exists()
