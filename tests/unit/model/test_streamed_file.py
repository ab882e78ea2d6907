"""A safetensors file written one tensor at a time (``workers.model.streamed_file``)
reads back, with any safetensors reader, as ``save_file``'s does; a tensor that does
not match the header it was declared with is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from treadle.workers.model import streamed_file
from treadle.workers.model.streamed_file import Entry


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "z.weight": torch.randn(3, 5, dtype=torch.float64, generator=gen),
        "a.weight": torch.randn(7, generator=gen),  # not in name order
        "b.half": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "ids": torch.arange(5),
        "t.view": torch.randn(4, 6, generator=gen).t(),  # not contiguous
    }


def test_a_streamed_file_reads_back_whole(tmp_path: Path) -> None:
    tensors = _tensors()
    entries = [Entry.of(n, t) for n, t in tensors.items()]
    path = streamed_file.write(
        tmp_path / "m.safetensors", entries, iter(tensors.items()), {"format": "pt"}
    )
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert header % 8 == 0  # the data starts 8-byte aligned, as save_file's does
    assert path.stat().st_size == 8 + header + sum(e.nbytes for e in entries)


def test_a_tensor_unlike_its_entry_is_refused(tmp_path: Path) -> None:
    tensors = _tensors()
    entries = [Entry.of(n, t) for n, t in tensors.items()]
    wrong = dict(tensors, **{"a.weight": torch.randn(8)})
    with pytest.raises(ValueError, match="a.weight"):
        streamed_file.write(tmp_path / "m.safetensors", entries, wrong.items())
    with pytest.raises(ValueError, match="tensors written"):
        streamed_file.write(tmp_path / "m.safetensors", entries, list(tensors.items())[:-1])
