"""A full fine-tune's versions on its vLLM engine (``workers.vllm.full``), without
vLLM: a version published as a file is reloaded from that file (nothing written at
the swap); one held in memory (shipped from another worker) is written to a scratch
directory first, removed when the next version is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.loading import load_checkpoint
from treadle.workers.model.published import WeightsFile, WholeWeights
from treadle.workers.model.streamed_file import Entry
from treadle.workers.vllm.full import FullVersions, is_full


class _Llm:
    def __init__(self) -> None:
        self.paths: list[Path] = []

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        assert method == "reload_weights"
        path = Path(kwargs["weights_path"])
        load_checkpoint(path)  # what vLLM reads is a whole checkpoint
        self.paths.append(path)

    def reset_prefix_cache(self) -> None:
        pass


class _Row:
    def __init__(self, weights: WeightSnapshot) -> None:
        self.weights = weights


def test_versions_load_from_their_file_or_a_scratch_copy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)
    params = base.weights_copy()
    named = dict(params.named_tensors())
    entries = tuple(Entry.of(n, t) for n, t in named.items())
    whole = WholeWeights("m", 1, base.cfg, entries, iter(named.items()), torch.device("cpu"))
    in_file = WeightSnapshot("m", 1, WeightsFile.write(whole, tmp_path), None)
    in_memory = WeightSnapshot("m", 2, params, None)
    assert is_full(in_file, base) and is_full(in_memory, base) and not base.loaded

    full, llm = FullVersions("m", base.cfg), _Llm()
    for snap in (in_file, in_memory, in_file):
        assert not full.admit(_Row(snap))  # type: ignore[arg-type]
        assert [r.weights for r in full.next_rows(llm, 0)] == [snap]
        assert full.holds(snap)
    assert isinstance(in_file.weights, WeightsFile)
    first, scratch, again = llm.paths
    assert first == again == in_file.weights.directory  # its own file, twice
    assert scratch != first and not scratch.exists()  # written for it, gone after
    full.close()
    assert in_file.weights.directory.exists()  # the version's: kept while it is held
