"""A Celery worker's configuration (``treadle worker``): one frozen, validated
object, read from flags and environment (``TREADLE_*``) in this one place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from treadle.common.logs import add_observe_flags, metrics_port_of
from treadle.errors import InvalidArgumentError
from treadle.workers.engine.flags import (
    add_engine_flags,
    add_model_flag,
    add_store_flags,
    check_engine_settings,
    engine_settings,
    models_from_args,
)
from treadle.workers.engine.options import EngineOptions

#: ``treadle worker --role``
ROLES = ("both", "trainer", "sampler")


@dataclass(frozen=True)
class WorkerConfig(EngineOptions):
    models: Mapping[str, Path] = field(default_factory=dict)  # base model name -> HF directory
    broker: str = ""
    database_url: str = ""
    store: str = ""  # "" = <data_dir>/checkpoints (a directory shared with the server)
    s3_endpoint_url: str = ""
    data_dir: Path = Path("treadle-worker")  # staging for checkpoints on their way to S3
    worker_id: str = ""  # "" = w-<host>-<random>
    capacity: int = 64  # training models this worker hosts at most
    heartbeat_s: float = 2.0
    #: on SIGTERM, serve this long at most while servers move the models off (0: stop
    #: at once, and the models still here are lost). Longer than the embedded
    #: server's (30 s) on purpose: running out here loses the models still on the
    #: worker, as a crash does (brought back by replay, or from their last
    #: checkpoint), and each move waits for the model's idle moment and writes its
    #: checkpoint through the shared store; the server's own stop, run out,
    #: still checkpoints what is applied (``ServerConfig``)
    drain_timeout_s: float = 60.0
    #: Prometheus metrics on http://metrics_host:metrics_port/metrics (None: off; 0: any port)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: ``both``: trains and samples (one colocated worker); ``trainer``: hosts training
    #: models, and the samplers the server keeps colocated; ``sampler``: a pool worker,
    #: serves samplers of its base models (and the versions shipped to it), never a
    #: training model nor an ordered call
    role: str = "both"

    def __post_init__(self) -> None:
        from treadle.common.celery_app import check_broker_url
        from treadle.common.db.engine import parse_database_url

        if not self.models:
            raise InvalidArgumentError("model: a worker serves at least one base model (--model)")
        for name, path in self.models.items():
            if not (Path(path) / "config.json").exists():
                raise InvalidArgumentError(
                    f"model {name}: {path} has no config.json (an HF model directory)"
                )
        if not self.broker:
            raise InvalidArgumentError("broker: required (redis://... or amqp://...)")
        check_broker_url(self.broker)
        if not self.database_url:
            raise InvalidArgumentError(
                "database_url: required; the server's database (postgresql+psycopg://...)"
            )
        parse_database_url(self.database_url)
        check_engine_settings(self)
        if self.role not in ROLES:
            raise InvalidArgumentError(
                f"role: {self.role!r} is not one of {', '.join(ROLES)} (--role)"
            )
        for name, ok in (
            ("capacity", self.capacity >= 1),
            ("heartbeat_s", self.heartbeat_s > 0),
            ("drain_timeout_s", self.drain_timeout_s >= 0),
        ):
            if not ok:
                raise InvalidArgumentError(f"{name}: out of range ({getattr(self, name)})")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_model_flag(parser)
    parser.add_argument(
        "--broker", default=env("TREADLE_BROKER", ""), help="redis://... or amqp://..."
    )
    parser.add_argument(
        "--database-url",
        default=env("TREADLE_DATABASE_URL", ""),
        help="the server's database, e.g. postgresql+psycopg://user@host/treadle",
    )
    add_store_flags(parser, "shared with the server")
    parser.add_argument("--data-dir", default=env("TREADLE_DATA_DIR", "treadle-worker"))
    parser.add_argument("--worker-id", default=env("TREADLE_WORKER_ID", ""))
    parser.add_argument("--capacity", type=int, default=int(env("TREADLE_CAPACITY", "64")))
    parser.add_argument("--heartbeat", type=float, default=float(env("TREADLE_HEARTBEAT_S", "2")))
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("TREADLE_DRAIN_TIMEOUT_S", WorkerConfig.drain_timeout_s)),
        help="on SIGTERM, keep serving up to this many seconds while the servers checkpoint "
        "this worker's models and move them to other workers (0: stop at once; a second "
        "SIGTERM, or SIGINT, stops at once too). Default 60, above treadle serve's 30: "
        "models still here when it runs out are lost, as in a crash",
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        default=env("TREADLE_WORKER_ROLE", "both"),
        help="both (default): trains and samples; trainer: training models only, the "
        "sampler pool samples for them; sampler: a pool worker that serves samplers "
        "(weights shipped per version through the store), never a training call",
    )
    add_engine_flags(parser)
    add_observe_flags(parser)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        models=models_from_args(args),
        broker=args.broker,
        database_url=args.database_url,
        store=args.store,
        s3_endpoint_url=args.s3_endpoint_url,
        data_dir=Path(args.data_dir),
        worker_id=args.worker_id,
        capacity=args.capacity,
        heartbeat_s=args.heartbeat,
        drain_timeout_s=args.drain_timeout,
        **engine_settings(args),
        metrics_port=metrics_port_of(args),
        metrics_host=args.metrics_host,
        role=args.role,
    )
