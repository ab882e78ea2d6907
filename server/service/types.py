"""The service layer's own request and result types (frozen dataclasses).

Transports build these from their wire messages and turn the results back into
wire messages (``server.rpc.convert`` for gRPC); the service never sees either
wire. The engine's op and result types (``treadle.common.engine.domain``) are used as
they are where they already say what is meant.

Their names say their layer: what the service answers about a model, a
checkpoint or a base model is a ``...Record`` (the SDK's public ``ModelInfo``,
``CheckpointInfo`` and ``BaseModelInfo`` are the client's view of the same facts,
and the proto's messages the wire's); a request for a new model is a
``NewModel`` (``CreateModel`` is the engine's message and the RPC's name).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, Union

from treadle.errors import TreadleError
from treadle.server.restarts import ClientNumbering

T = TypeVar("T")

#: what a transport parsed from its request: the value, or the error that names
#: the field that was wrong. An ordered call's bad input still takes its seq_id
#: (the model's later calls must not wait for it), so the service, not the
#: transport, decides when such an error is raised.
Parsed = Union[T, TreadleError]  # noqa: UP007 (a generic alias, subscripted below)


def parse(build: Callable[[], T]) -> T | TreadleError:
    """Run a transport's conversion, keeping its ``TreadleError`` as the value."""
    try:
        return build()
    except TreadleError as err:
        return err


def unwrap(value: T | TreadleError) -> T:
    """The parsed value, or its error raised."""
    if isinstance(value, TreadleError):
        raise value
    return value


@dataclass(frozen=True)
class OrderedCall:
    """The identity of one ordered call on a training model.

    ``digest`` is a stable digest of the call's payload, computed by the
    transport from its own encoding: a repeat of ``(model_id, seq_id)`` with the
    same digest gets the recorded result, with another one FAILED_PRECONDITION.
    ``numbering``: what the client said of its numbering (``server.restarts``)."""

    model_id: str
    seq_id: int
    digest: str
    numbering: ClientNumbering = ClientNumbering()


@dataclass(frozen=True)
class NewModel:
    """A new training model: LoRA (``lora_rank`` > 0) or a full fine-tune (0), or,
    with ``from_state``, a copy of a checkpoint's model (its settings then
    override every other field)."""

    base_model: str = ""
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0: the rank
    seed: int = 0
    dtype: str = ""  # "": the server's default
    modules: tuple[bool, bool, bool] = (True, True, True)  # attn, mlp, unembed
    from_state: str = ""  # treadle://<model_id>/state/<name> of the same tenant
    session_id: str = ""
    #: with from_state: load its weights only; the Adam moments start fresh
    weights_only: bool = False
    #: the caller's notes on the run, checked (``service.run_metadata``)
    user_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    base_model: str
    is_lora: bool
    lora_rank: int
    dtype: str
    version: int
    next_seq_id: int  # 0: unknown (the model is neither loaded nor unloaded)
    last_checkpoint_seq_id: int
    status: str  # "active" | "unloaded" | "lost"
    created_at: float  # unix seconds
    session_id: str
    user_metadata: Mapping[str, str] = field(default_factory=dict)
    #: unix seconds of the last call on it that started or ended (this server's
    #: view; the row's last update when this server has seen none)
    last_request_at: float = 0.0


@dataclass(frozen=True)
class CheckpointRecord:
    path: str  # treadle://<model_id>/state/<name>
    name: str
    seq_id: int
    step: int
    created_at: float
    size_bytes: int
    model_id: str = ""
    public: bool = False
    expires_at: float | None = None  # unix seconds; None: never


@dataclass(frozen=True)
class SyncOutcome:
    version: int
    weights_uri: str  # treadle://<model_id>/v/<version>
    sampler_id: str = ""  # set when the call asked for a sampler pinned to it


@dataclass(frozen=True)
class SavedState:
    path: str  # treadle://<model_id>/state/<name>
    seq_id: int
    step: int


@dataclass(frozen=True)
class SamplerSource:
    """What a new sampler reads: a served base model, or a model's weights
    (``treadle://<model_id>/latest`` follows each sync, ``.../v/<n>`` is pinned).
    Exactly one is given (None: not given)."""

    base_model: str | None = None
    weights: str | None = None
    #: where it samples (one of ``SAMPLER_PLACEMENTS``); "" = the server's
    #: ``--sampler-placement``
    placement: str = ""


@dataclass(frozen=True)
class SamplerInfo:
    sampler_id: str
    base_model: str
    model_id: str  # "" for a base-model sampler
    version: int  # -1 when it follows the latest weights
    follows_latest: bool


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    heartbeat_interval_s: float
    created_at: float  # unix seconds


#: how a client may say it finished its session (tinker's ``sessions/{id}/finish``)
FINISH_REASONS = ("success", "errored", "interrupted")


@dataclass(frozen=True)
class SessionQuery:
    """A search of a tenant's sessions, newest first: ``session_id`` or every word
    of ``display_name`` (either, when both), every pair of ``user_metadata``, and
    a status among ``statuses`` ("active" or one of ``FINISH_REASONS``; None: any,
    empty: none);
    a page of ``limit`` starting after ``after`` (the previous page's last
    (created_at, session id))."""

    session_id: str | None = None
    display_name: str | None = None
    user_metadata: tuple[tuple[str, str], ...] = ()
    statuses: frozenset[str] | None = None
    limit: int = 50
    after: tuple[dt.datetime, str] | None = None


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    created_at: dt.datetime
    display_name: str | None
    user_metadata: dict[str, str] | None
    active: bool
    finish_reason: str | None  # the client's, when it finished the session itself
    finish_detail: str | None
    checkpoints: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class SessionPage:
    sessions: tuple[SessionSummary, ...]
    #: where the next page starts; None when this one is the last
    next_after: tuple[dt.datetime, str] | None


@dataclass(frozen=True)
class TimelineCall:
    """An ordered call of a training run, from the ops log: admitted at
    ``admitted``, ended (applied or failed) at ``ended`` (None: not yet)."""

    model_id: str
    seq_id: int
    kind: str
    status: str
    error_code: str | None
    admitted: dt.datetime
    ended: dt.datetime | None


@dataclass(frozen=True)
class SessionTimeline:
    """What a session did, for its trace: its training runs (id, created), their
    ordered calls, and its samplers (id, model id or None for a base, created)."""

    session_id: str
    created_at: dt.datetime
    ended_at: dt.datetime | None
    models: tuple[tuple[str, dt.datetime], ...]
    calls: tuple[TimelineCall, ...]
    samplers: tuple[tuple[str, str | None, dt.datetime], ...]


@dataclass(frozen=True)
class WorkerRecord:
    """A serving worker of a distributed server (``treadle worker``)."""

    worker_id: str
    role: str  # both | trainer | sampler
    status: str  # live | draining
    base_models: tuple[str, ...]


@dataclass(frozen=True)
class BaseModelRecord:
    """A base model this server serves."""

    name: str
    arch: str
    vocab_size: int
    max_context: int  # tokens of prompt and completion a sequence may hold
    num_params: int
    dtype: str  # the server's default compute dtype


@dataclass(frozen=True)
class RunUsageRecord:
    """What one training model (a run) used: its calls, and its samplers' samples."""

    model_id: str
    tokens_trained: int
    tokens_sampled: int
    tokens_scored: int
    calls: int
    device_s: float  # engine seconds spent on its calls
    cost: float | None  # at the operator's prices; None: no prices set
    currency: str


@dataclass(frozen=True)
class RunCurves:
    """A run's metrics per step: name -> [(step, value)], steps ascending.
    ``steps``: what its calls returned; ``logged``: what its client logged."""

    steps: dict[str, list[tuple[int, float]]]
    logged: dict[str, list[tuple[int, float]]]
