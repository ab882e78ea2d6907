"""The messages between the torch sampler's parent proxy and its child process
(``workers.sampler.process.proxy``, ``workers.sampler.process.child``), one type each.

The parent sends them in the order the engine decides (so an in-flight update
lands before any request sent after it); the child answers with streamed
sequences, results, released buffers and stats. Tensors inside travel through
shared memory (``workers.sampler.process.shm``) as they are pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig, SequenceResult
from treadle.common.engine.stats import SamplerStats
from treadle.errors import TreadleError
from treadle.workers.engine.base_models import BaseModel

BaseKey = tuple[str, str]  # (base model name, dtype name)

# ---- parent -> child --------------------------------------------------------------


@dataclass(frozen=True)
class AddBase:
    """A base model the child has not seen (its tensors in shared memory)."""

    bkey: BaseKey
    base: BaseModel


@dataclass(frozen=True)
class AddSnapshot:
    """A weight version under key ``skey``; ``params`` None: the base's weights.
    ``evict``: keys the child may forget (rows reading them keep them alive)."""

    skey: int
    bkey: BaseKey
    model_id: str | None
    version: int
    params: Any  # shm.Flat | dict[str, Tensor] | None
    adapter: Any  # (shm.Flat | dict[str, Tensor], alpha) | None
    evict: tuple[int, ...]


@dataclass(frozen=True)
class SampleJobMsg:
    """A ``SampleJob`` as it crosses: its base and weights by key (shipped once)."""

    rid: int
    bkey: BaseKey
    op: SampleOp
    skey: int
    target: SamplerTarget
    stream: bool  # report each sequence as it finishes


@dataclass(frozen=True)
class ResumeJobMsg:
    """A ``ResumeJob`` as it crosses: its base and weights by key."""

    rid: int
    bkey: BaseKey
    handles: tuple[str, ...]
    params: SamplingConfig
    skey: int
    target: SamplerTarget


@dataclass(frozen=True)
class Swap:
    """An in-flight update to the version of ``skey``."""

    skey: int


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class StatsPlease:
    pass


@dataclass(frozen=True)
class FailAll:
    error: TreadleError


@dataclass(frozen=True)
class Stop:
    pass


ToChild = (
    AddBase
    | AddSnapshot
    | SampleJobMsg
    | ResumeJobMsg
    | Swap
    | Cancel
    | StatsPlease
    | FailAll
    | Stop
)

# ---- child -> parent --------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    parent_pid: int


@dataclass(frozen=True)
class Streamed:
    rid: int
    index: int
    sequence: SequenceResult
    seconds: float


@dataclass(frozen=True)
class Done:
    rid: int
    outcome: Any  # SampleResult | BaseException


@dataclass(frozen=True)
class Released:
    """Snapshot keys whose shared buffers no tensor in the child is on any more."""

    skeys: tuple[int, ...]


@dataclass(frozen=True)
class Stats:
    stats: tuple[tuple[BaseKey, SamplerStats], ...]


ToParent = Ready | Streamed | Done | Released | Stats
