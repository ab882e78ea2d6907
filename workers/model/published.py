"""A full fine-tune's published weights: handed over one whole tensor at a time
(``WholeWeights``) and kept the way the sampler backend reads them
(``SamplerBackend.keep_weights``): a clone in memory (``clone_weights``, the torch
samplers), one shared-memory buffer (a sampler process), or a checkpoint
directory written as they come (``WeightsFile``, vLLM, which reloads its weights
from a path).

Why one tensor at a time: on a worker group a full fine-tune is sharded, and
rank 0 gathers each tensor in turn (``Peers.published``). A keeper that copies
each as it comes holds the version and one whole tensor beyond the shards, never
the whole weights twice; a ``WeightsFile`` holds none of them in the process.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model import streamed_file
from treadle.workers.model.loading import SINGLE_FILE, load_checkpoint, save_config
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.streamed_file import Entry


@dataclass(frozen=True)
class WholeWeights:
    """A full fine-tune's weights to publish as ``version``, whole one tensor at a time.

    ``entries``: each tensor's HF name, dtype and whole shape, in order, known at
    once; ``tensors`` yields each (name, whole tensor) in that order, once (on a
    group each gathered as it is reached). A tensor it yields is not the reader's
    to keep (it may be the model's own): a keeper copies what it keeps."""

    model_id: str
    version: int
    cfg: ModelConfig
    entries: tuple[Entry, ...]
    tensors: Iterator[tuple[str, Tensor]]
    #: where the model's weights live (what a copy read back is put on)
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return self.entries[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


#: keeps the published weights it is handed (``SamplerBackend.keep_weights``)
WeightsKeeper = Callable[[WholeWeights], "LlamaParams | WeightsFile"]


@torch.no_grad()
def clone_weights(weights: WholeWeights) -> LlamaParams:
    """A plain detached clone of each tensor as it comes (the torch samplers'), each
    let go before the next is asked for (on a group: before it is gathered)."""
    clones = {}
    for name, t in weights.tensors:
        clones[name] = t.detach().clone()
        del t
    return LlamaParams.from_state_dict(weights.cfg, clones)


#: a version directory's name: this prefix, the writing process's id, the model, the version
_PREFIX = "treadle-version-"


class WeightsFile:
    """A published version's weights as a checkpoint directory (``config.json`` and
    ``model.safetensors``, HF names: what ``load_checkpoint`` and vLLM's weight reload
    read), written one tensor at a time as they come (``write``).

    Nothing of it stays in the process: a sampler that reloads weights from a path
    (vLLM) reads the file; a reader of the tensors (a reference pass naming the
    version, shipping it to another worker) reads it whole when it asks (``read``),
    and lets that copy go after. The directory is removed when the last holder
    lets the object go, so a version the store released stays readable for the
    requests still holding it, as one in memory does."""

    def __init__(
        self, directory: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.directory = directory
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self._removal = weakref.finalize(self, shutil.rmtree, str(directory), True)

    @staticmethod
    def write(weights: WholeWeights, parent: Path | None = None) -> WeightsFile:
        """``weights`` written under a new directory in ``parent`` (the system's
        temporary directory if None), each tensor written and let go as it comes."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", weights.model_id)[:64]
        out = version_dir(f"{name}-v{weights.version}", parent)
        try:
            streamed_file.write(
                out / SINGLE_FILE, weights.entries, weights.tensors, {"format": "pt"}
            )
            save_config(weights.cfg, weights.dtype, out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return WeightsFile(out, weights.cfg, weights.dtype, weights.device)

    def read(self) -> LlamaParams:
        """The weights whole (a new copy each time: nothing is kept here)."""
        _, params = load_checkpoint(self.directory, dtype=self.dtype, device=self.device)
        return params.requires_grad_(False)

    @property
    def nbytes(self) -> int:
        return (self.directory / SINGLE_FILE).stat().st_size


def version_dir(label: str, parent: Path | None = None) -> Path:
    """A new directory for a version's files in ``parent`` (the system's temporary
    directory if None), named so that ``remove_orphans`` finds it once this process
    is gone."""
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-{label}-", dir=parent))


def remove_orphans(parent: Path | None = None) -> list[Path]:
    """Remove the version directories in ``parent`` (the system's temporary directory
    if None) whose writing process is gone: a process killed (SIGKILL) never ran
    their removal, and in ``/dev/shm`` they would hold memory until a reboot. The
    directories removed."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{_PREFIX}*"):
        pid = path.name.removeprefix(_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
