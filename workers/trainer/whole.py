"""A model's tensors whole, one at a time: what a read that writes them out (a
checkpoint, a merged export) walks, so that on a group of ranks rank 0 never
holds more than one whole tensor beyond its shards.

A tensor sharded over the group (an FSDP ``DTensor``: a full fine-tune's weights
and Adam moments, a LoRA model's base where rank 0 keeps only its shards) is
all-gathered when it is reached (``DTensor.full_tensor()``) and let go by the
reader after use; a tensor held whole is read as it is. Every rank walks the
same tensors in the same order (``walk``): rank 0 reads them (``WholeTensors``),
the others join each gather and drop the result (``join``). On a model held
whole (one rank; a LoRA model whose base rank 0 keeps whole) nothing is
gathered and no other rank takes part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from treadle.workers.model.streamed_file import Entry
from treadle.workers.trainer.trainer import TrainingModel

WEIGHTS = "weights"
MOMENTS = "moments"


@dataclass(frozen=True)
class Step:
    """One tensor of a walk: its part (``WEIGHTS`` or ``MOMENTS``), its name in the
    files (HF names; ``exp_avg.<name>`` / ``exp_avg_sq.<name>``), the tensor as this
    rank holds it (a ``DTensor`` when sharded)."""

    part: str
    name: str
    tensor: Tensor


def walk(model: TrainingModel, *, moments: bool) -> list[Step]:
    """The tensors a whole read of ``model`` reaches, in the one order every rank
    walks: ``model.params`` (a full fine-tune's weights, a LoRA model's base) in
    ``named_tensors`` order, then with ``moments`` (a full fine-tune's) each
    weight's two Adam moments in ``state_tensors`` order."""
    params = dict(model.params.named_tensors())
    steps = [Step(WEIGHTS, name, t) for name, t in params.items()]
    if moments:
        if model.adapter is not None:
            raise TypeError("a LoRA model's moments are its adapter's, held whole")
        opt = model.optimizer
        for name, p in params.items():
            steps.append(Step(MOMENTS, f"exp_avg.{name}", _laid_out_as(p, opt.exp_avg[name])))
            steps.append(Step(MOMENTS, f"exp_avg_sq.{name}", _laid_out_as(p, opt.exp_avg_sq[name])))
    return steps


def sharded(model: TrainingModel, *, moments: bool = False) -> bool:
    """Whether reading ``model`` whole gathers anything (every other rank must join)."""
    return any(isinstance(s.tensor, DTensor) for s in walk(model, moments=moments))


def entries(steps: list[Step], part: str) -> list[Entry]:
    """The file header of a part: each tensor's name, dtype and whole shape."""
    return [Entry.of(s.name, s.tensor) for s in steps if s.part == part]


class WholeTensors:
    """Rank 0 (or a model held whole): each tensor of ``walk(model)`` whole in turn.

    ``weights()`` then ``moments()`` yield (name, whole tensor); each is gathered
    when reached (the other ranks join with ``join``). Reading a part skips (and
    still gathers) what is left of the parts before it; ``close`` gathers what
    was not read, so the other ranks' gathers always complete."""

    def __init__(self, model: TrainingModel, *, moments: bool = False) -> None:
        self.steps = walk(model, moments=moments)
        self._at = 0

    def entries(self, part: str) -> list[Entry]:
        return entries(self.steps, part)

    def weights(self) -> Iterator[tuple[str, Tensor]]:
        return self._part(WEIGHTS)

    def moments(self) -> Iterator[tuple[str, Tensor]]:
        return self._part(MOMENTS)

    def close(self) -> None:
        while self._at < len(self.steps):
            _whole(self.steps[self._at].tensor)
            self._at += 1

    def _part(self, part: str) -> Iterator[tuple[str, Tensor]]:
        if any(s.part == part for s in self.steps[: self._at]):
            raise ValueError(f"the {part} part was read already")
        while self._at < len(self.steps) and self.steps[self._at].part != part:
            _whole(self.steps[self._at].tensor)  # an earlier part, not read: gathered all the same
            self._at += 1
        while self._at < len(self.steps) and self.steps[self._at].part == part:
            step = self.steps[self._at]
            self._at += 1
            yield step.name, _whole(step.tensor)


@torch.no_grad()
def join(model: TrainingModel, *, moments: bool = False) -> None:
    """A rank other than 0: joins rank 0's ``WholeTensors`` of ``model`` (each gather;
    the whole tensor is dropped here at once)."""
    for step in walk(model, moments=moments):
        if isinstance(step.tensor, DTensor):
            step.tensor.full_tensor()


@torch.no_grad()
def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _laid_out_as(p: Tensor, local: Tensor) -> Tensor:
    """``local`` (a moment's shard) as a DTensor laid out as parameter ``p``'s; as it is
    when ``p`` is whole."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
