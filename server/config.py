"""The server's configuration: one frozen, validated object, read from flags and
environment (``TREADLE_*``) in this one place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from treadle.common.engine.domain import SAMPLER_PLACEMENTS
from treadle.common.logs import add_observe_flags, metrics_port_of
from treadle.errors import InvalidArgumentError
from treadle.server.accounting.prices import Prices, parse_prices
from treadle.server.accounting.quotas import QuotaLimits
from treadle.wire.channel import MAX_MESSAGE_BYTES
from treadle.workers.engine.flags import (
    add_engine_flags,
    add_model_flag,
    add_store_flags,
    check_engine_settings,
    engine_settings,
    models_from_args,
)
from treadle.workers.engine.options import EngineOptions

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class ServerConfig(EngineOptions):
    data_dir: Path = Path("treadle-data")
    models: Mapping[str, Path] = field(default_factory=dict)  # base model name -> HF directory
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (tests)
    #: the tinker-compatible HTTP API (/api/v1) on this port; 0 = any free port,
    #: None = off (`treadle serve` turns it on at the gRPC port + 1: --http-port)
    http_port: int | None = None
    database_url: str = ""  # "" = SQLite file in data_dir
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: TLS on the gRPC port: PEM certificate chain and private key (both or neither)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: unload (checkpoint, then free) a model idle this long: no calls and no
    #: heartbeat of its session; 0 = never
    model_ttl_s: float = 3600.0
    #: how often the server looks for idle models (0 = min(ttl / 4, 30 s))
    ttl_sweep_s: float = 0.0
    #: a graceful stop (SIGTERM/SIGINT) serves on at most this long while it
    #: checkpoints each model at its first idle moment; then it checkpoints what
    #: is applied and stops. Shorter than the worker's (60 s) on purpose: running
    #: out costs little here (only the gradients of a step not yet taken, which the
    #: client is told to redo), so a planned restart is not held up long; a worker
    #: that runs out loses the models it still holds (``WorkerConfig``)
    drain_timeout_s: float = 30.0
    #: the heartbeat interval the server asks SDK sessions to keep
    heartbeat_interval_s: float = 10.0
    #: distributed mode: the Celery broker (redis://... or amqp://...); "" = engine in-process
    broker: str = ""
    #: checkpoint store: "" = <data_dir>/checkpoints, a directory, or s3://bucket/prefix
    store: str = ""
    s3_endpoint_url: str = ""  # S3-compatible stores (MinIO, Ceph, moto)
    #: a worker whose heartbeat is older than this is dead and its models are lost
    worker_timeout_s: float = 15.0
    #: distributed mode: where a model's samplers sample (``server.celery.pool``):
    #: ``colocated`` on the model's trainer worker; ``pool`` on the sampler workers
    #: (``treadle worker --role sampler``) serving its base, each version shipped to
    #: them through the store; ``auto``: the pool when one serves the base, else colocated
    sampler_placement: str = "auto"
    #: distributed mode: the calls applied since a model's last checkpoint are kept in
    #: the database (at most this many bytes per model; 0 = none), so a model lost
    #: with its worker is replayed to its last applied step on another
    replay_log_bytes: int = 64 * 1024 * 1024
    #: API keys are required; off (--no-auth) only on a loopback address (dev)
    auth: bool = True
    auth_cache_s: float = 5.0  # a revoked key stops working within this many seconds
    bootstrap_api_key: str = ""  # the default tenant's first key; "" = a random one
    #: every tenant's default quotas (0 = unlimited); `treadle admin set-quota` overrides
    quota_max_models: int = 64
    quota_calls_in_flight: int = 256
    quota_tokens_per_request: int = 262_144
    quota_tokens_per_minute: int = 20_000_000
    usage_flush_s: float = 2.0  # how often usage counters are written to the database
    #: Prometheus metrics on http://metrics_host:metrics_port/metrics (None: off; 0: any port)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: what usage costs (``--prices``; the console and ``GetUsage`` show it)
    prices: Prices = field(default_factory=Prices)
    #: the tenant whose keys see the console's operator pages ("" = nobody's)
    admin_tenant: str = "default"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port: {self.port} is not a TCP port")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgumentError(f"metrics_port: {self.metrics_port} is not a TCP port")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise InvalidArgumentError(f"http_port: {self.http_port} is not a TCP port")
        check_engine_settings(self)
        if self.broker and (self.ranks > 1 or self.nnodes > 1):
            raise InvalidArgumentError(
                "--ranks: a distributed server (--broker) runs no engine; give --ranks to "
                "each `treadle worker`"
            )
        for name, positive in (
            ("max_message_bytes", self.max_message_bytes >= 4 * 1024 * 1024),
            ("model_ttl_s", self.model_ttl_s >= 0),
            ("ttl_sweep_s", self.ttl_sweep_s >= 0),
            ("drain_timeout_s", self.drain_timeout_s >= 0),
            ("heartbeat_interval_s", self.heartbeat_interval_s > 0),
            ("auth_cache_s", self.auth_cache_s >= 0),
            ("quota_max_models", self.quota_max_models >= 0),
            ("quota_calls_in_flight", self.quota_calls_in_flight >= 0),
            ("quota_tokens_per_request", self.quota_tokens_per_request >= 0),
            ("quota_tokens_per_minute", self.quota_tokens_per_minute >= 0),
            ("usage_flush_s", self.usage_flush_s > 0),
        ):
            if not positive:
                raise InvalidArgumentError(f"{name}: out of range ({getattr(self, name)})")
        if not self.auth and self.host not in LOOPBACK_HOSTS:
            raise InvalidArgumentError(
                f"auth: --no-auth serves every caller as one tenant; it is allowed only on a "
                f"loopback host ({', '.join(LOOPBACK_HOSTS)}), not {self.host!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgumentError("tls_cert, tls_key: give both (PEM files) or neither")
        for name, tls_path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key)):
            if tls_path is not None and not Path(tls_path).is_file():
                raise InvalidArgumentError(f"{name}: {tls_path} is not a file")
        self._check_urls()
        for name, path in self.models.items():
            if not (Path(path) / "config.json").exists():
                raise InvalidArgumentError(
                    f"model {name}: {path} has no config.json (an HF model directory)"
                )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'treadle.db').resolve()}"

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def sweep_interval_s(self) -> float:
        return self.ttl_sweep_s or min(self.model_ttl_s / 4, 30.0)

    def _check_urls(self) -> None:
        """Malformed URLs fail at start-up with what to write instead."""
        if self.database_url:
            from treadle.common.db.engine import parse_database_url

            parse_database_url(self.database_url)
        if self.broker:
            from treadle.common.celery_app import check_broker_url

            check_broker_url(self.broker)
        if self.store.startswith("s3:"):
            from treadle.common.s3_store import parse_s3_url

            parse_s3_url(self.store)
        elif "://" in self.store:
            raise InvalidArgumentError(
                f"store: {self.store!r}: give a directory or s3://bucket/prefix"
            )
        if self.sampler_placement not in SAMPLER_PLACEMENTS:
            raise InvalidArgumentError(
                f"sampler_placement: {self.sampler_placement!r} is not one of "
                f"{', '.join(SAMPLER_PLACEMENTS)} (--sampler-placement)"
            )
        if self.worker_timeout_s <= 0:
            raise InvalidArgumentError(f"worker_timeout_s: out of range ({self.worker_timeout_s})")
        if self.replay_log_bytes < 0:
            raise InvalidArgumentError(f"replay_log_bytes: out of range ({self.replay_log_bytes})")

    @property
    def checkpoint_root(self) -> Path:
        """Local checkpoints (and the staging area of an S3 store)."""
        if self.store and not self.store.startswith("s3:"):
            return Path(self.store)
        return self.data_dir / "checkpoints"

    @property
    def quota_limits(self) -> QuotaLimits:
        return QuotaLimits(
            max_models=self.quota_max_models,
            max_calls_in_flight=self.quota_calls_in_flight,
            max_tokens_per_request=self.quota_tokens_per_request,
            tokens_per_minute=self.quota_tokens_per_minute,
        )

    def with_(self, **changes: object) -> ServerConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_tenancy_flags(parser)
    add_model_flag(parser)
    parser.add_argument("--data-dir", default=env("TREADLE_DATA_DIR", "treadle-data"))
    parser.add_argument("--host", default=env("TREADLE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("TREADLE_PORT", "50051")))
    http_port = env("TREADLE_HTTP_PORT")
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(http_port) if http_port else None,
        help="port of the tinker-compatible HTTP API (/api/v1, for the official tinker "
        "SDK); default: the gRPC --port + 1 (50052; any free port with --port 0), so "
        "servers on different --ports never collide; -1 = off; env TREADLE_HTTP_PORT",
    )
    parser.add_argument(
        "--database-url",
        default=env("TREADLE_DATABASE_URL", ""),
        help="default: SQLite in the data dir; PostgreSQL: postgresql+psycopg://...",
    )
    add_engine_flags(parser)
    add_observe_flags(parser)
    parser.add_argument(
        "--tls-cert",
        default=env("TREADLE_TLS_CERT", ""),
        help="PEM certificate (chain) for TLS on the gRPC port; needs --tls-key",
    )
    parser.add_argument(
        "--tls-key", default=env("TREADLE_TLS_KEY", ""), help="PEM private key of --tls-cert"
    )
    parser.add_argument(
        "--model-ttl-s",
        type=float,
        default=float(env("TREADLE_MODEL_TTL_S", "3600")),
        help="checkpoint and unload a model after this many idle seconds (no calls, no "
        "session heartbeat); it comes back on its next call. 0 = never",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("TREADLE_DRAIN_TIMEOUT_S", ServerConfig.drain_timeout_s)),
        help="on SIGTERM/SIGINT, serve on at most this many seconds while every model is "
        "checkpointed at its first idle moment, then checkpoint what is applied and stop "
        "(a second signal stops at once). Default 30, below a worker's 60: running out "
        "here drops only the gradients of a step not yet taken",
    )
    parser.add_argument(
        "--broker",
        default=env("TREADLE_BROKER", ""),
        help="run engines in `treadle worker` processes through Celery: redis://host:6379/0 "
        "or amqp://user:pass@host:5672//; default: the engine runs in this process",
    )
    add_store_flags(parser, "default: DATA_DIR/checkpoints")
    parser.add_argument(
        "--prices",
        default=env("TREADLE_PRICES", ""),
        help="what usage costs, shown by the console and GetUsage: "
        "'trained=1.5,sampled=0.5,scored=0.25,device_hour=2,currency=USD' (per million "
        "tokens; per hour of engine time); default: no cost shown",
    )
    parser.add_argument(
        "--admin-tenant",
        default=env("TREADLE_ADMIN_TENANT", "default"),
        help="the tenant whose API keys see the web console's operator pages (tenants, "
        "workers, queue); '' = nobody's. Default: the default tenant",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=float(env("TREADLE_WORKER_TIMEOUT_S", "15")),
        help="seconds without a heartbeat after which a worker is dead and its models lost",
    )
    parser.add_argument(
        "--sampler-placement",
        choices=SAMPLER_PLACEMENTS,
        default=env("TREADLE_SAMPLER_PLACEMENT", "auto"),
        help="distributed mode: where samplers of trained models sample: colocated (on the "
        "model's worker), pool (on `treadle worker --role sampler` workers, each version "
        "shipped through the store), auto (default: the pool when one serves the base)",
    )
    parser.add_argument(
        "--replay-log-bytes",
        type=int,
        default=int(env("TREADLE_REPLAY_LOG_BYTES", str(64 * 1024 * 1024))),
        help="per model, the bytes of calls kept since its last checkpoint, to replay a model "
        "lost with its worker to its last applied step (0 = keep none: back at the checkpoint)",
    )


def add_tenancy_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    defaults = QuotaLimits()
    parser.add_argument(
        "--no-auth",
        action="store_true",
        default=env("TREADLE_NO_AUTH", "") not in ("", "0"),
        help="no API keys: every caller is the default tenant (loopback hosts only, for dev)",
    )
    parser.add_argument(
        "--auth-cache-s",
        type=float,
        default=float(env("TREADLE_AUTH_CACHE_S", "5")),
        help="seconds a key lookup is cached (a revoked key works at most this long)",
    )
    for flag, name, default, what in (
        ("--quota-max-models", "MAX_MODELS", defaults.max_models, "models per tenant"),
        (
            "--quota-calls-in-flight",
            "CALLS_IN_FLIGHT",
            defaults.max_calls_in_flight,
            "calls in flight per tenant",
        ),
        (
            "--quota-tokens-per-request",
            "TOKENS_PER_REQUEST",
            defaults.max_tokens_per_request,
            "tokens in one request",
        ),
        (
            "--quota-tokens-per-minute",
            "TOKENS_PER_MINUTE",
            defaults.tokens_per_minute,
            "tokens sampled + trained per tenant per minute",
        ),
    ):
        parser.add_argument(
            flag,
            type=int,
            default=int(env(f"TREADLE_QUOTA_{name}", str(default))),
            help=f"default quota: {what} (0 = unlimited; env TREADLE_QUOTA_{name})",
        )


def tenancy_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of ``add_tenancy_flags``."""
    return {
        "auth": not args.no_auth,
        "auth_cache_s": args.auth_cache_s,
        "quota_max_models": args.quota_max_models,
        "quota_calls_in_flight": args.quota_calls_in_flight,
        "quota_tokens_per_request": args.quota_tokens_per_request,
        "quota_tokens_per_minute": args.quota_tokens_per_minute,
    }


def http_port_of(port: int, http_port: int | None) -> int | None:
    """The HTTP API's port: as given (negative: none), else the gRPC port's next
    one (any free port when the gRPC port is 0)."""
    if http_port is not None:
        return None if http_port < 0 else http_port
    if port == 0:
        return 0
    if port >= 65535:
        raise InvalidArgumentError(
            f"--http-port: the default is --port + 1, and {port} + 1 is not a TCP port; "
            "pass --http-port"
        )
    return port + 1


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        **tenancy_config(args),
        data_dir=Path(args.data_dir),
        models=models_from_args(args),
        host=args.host,
        port=args.port,
        http_port=http_port_of(args.port, args.http_port),
        database_url=args.database_url,
        **engine_settings(args),
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        model_ttl_s=args.model_ttl_s,
        drain_timeout_s=args.drain_timeout,
        broker=args.broker,
        store=args.store,
        s3_endpoint_url=args.s3_endpoint_url,
        worker_timeout_s=args.worker_timeout,
        sampler_placement=args.sampler_placement,
        metrics_port=metrics_port_of(args),
        metrics_host=args.metrics_host,
        replay_log_bytes=args.replay_log_bytes,
        prices=parse_prices(args.prices),
        admin_tenant=args.admin_tenant,
    )
