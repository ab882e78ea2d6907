"""The server's configuration: one frozen, validated object, read from flags and
environment (``TREADLE_*``) in this one place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from treadle._rpc import MAX_MESSAGE_BYTES
from treadle.errors import InvalidArgumentError

DTYPES = ("float32", "float64", "bfloat16")


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path = Path("treadle-data")
    models: Mapping[str, Path] = field(default_factory=dict)  # base model name -> HF directory
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (tests)
    database_url: str = ""  # "" = SQLite file in data_dir
    default_dtype: str = "float32"
    threads: int = 0  # torch threads of the engine; 0 = torch's default
    gap_timeout_s: float = 60.0
    keep_versions: int = 4
    auto_checkpoint_steps: int = 0  # 0 = off; else checkpoint every N optimizer steps
    sampler_slots: int = 64
    sampler_max_len: int = 1024
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_tokens_per_call: int = 262_144

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port: {self.port} is not a TCP port")
        if self.default_dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: {self.default_dtype!r}; choose from {DTYPES}")
        for name, positive in (
            ("gap_timeout_s", self.gap_timeout_s > 0),
            ("keep_versions", self.keep_versions >= 1),
            ("sampler_slots", self.sampler_slots >= 1),
            ("sampler_max_len", self.sampler_max_len >= 2),
            ("max_message_bytes", self.max_message_bytes >= 4 * 1024 * 1024),
            ("auto_checkpoint_steps", self.auto_checkpoint_steps >= 0),
            ("threads", self.threads >= 0),
        ):
            if not positive:
                raise InvalidArgumentError(f"{name}: out of range ({getattr(self, name)})")
        for name, path in self.models.items():
            if not (Path(path) / "config.json").exists():
                raise InvalidArgumentError(
                    f"model {name}: {path} has no config.json (an HF model directory)"
                )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'treadle.db').resolve()}"

    @property
    def checkpoint_root(self) -> Path:
        return self.data_dir / "checkpoints"

    def with_(self, **changes: object) -> ServerConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def parse_models(values: Sequence[str]) -> dict[str, Path]:
    """``--model DIR`` (named after the directory) or ``--model NAME=DIR``."""
    models: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).name, value
        models[name] = Path(path)
    return models


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="base model directory to serve (repeatable); env TREADLE_MODELS (comma-separated)",
    )
    parser.add_argument("--data-dir", default=env("TREADLE_DATA_DIR", "treadle-data"))
    parser.add_argument("--host", default=env("TREADLE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("TREADLE_PORT", "50051")))
    parser.add_argument(
        "--database-url",
        default=env("TREADLE_DATABASE_URL", ""),
        help="default: SQLite in the data dir; PostgreSQL: postgresql+psycopg://...",
    )
    parser.add_argument("--dtype", default=env("TREADLE_DTYPE", "float32"), choices=DTYPES)
    parser.add_argument("--threads", type=int, default=int(env("TREADLE_THREADS", "0")))
    parser.add_argument(
        "--gap-timeout",
        type=float,
        default=float(env("TREADLE_GAP_TIMEOUT_S", "60")),
        help="seconds a call waits for a missing earlier seq_id before ABORTED",
    )
    parser.add_argument("--keep-versions", type=int, default=int(env("TREADLE_KEEP_VERSIONS", "4")))
    parser.add_argument(
        "--auto-checkpoint-steps", type=int, default=int(env("TREADLE_AUTO_CHECKPOINT_STEPS", "0"))
    )
    parser.add_argument(
        "--sampler-slots", type=int, default=int(env("TREADLE_SAMPLER_SLOTS", "64"))
    )
    parser.add_argument(
        "--sampler-max-len", type=int, default=int(env("TREADLE_SAMPLER_MAX_LEN", "1024"))
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    model_values = list(args.model)
    if not model_values and os.environ.get("TREADLE_MODELS"):
        model_values = [m for m in os.environ["TREADLE_MODELS"].split(",") if m]
    return ServerConfig(
        data_dir=Path(args.data_dir),
        models=parse_models(model_values),
        host=args.host,
        port=args.port,
        database_url=args.database_url,
        default_dtype=args.dtype,
        threads=args.threads,
        gap_timeout_s=args.gap_timeout,
        keep_versions=args.keep_versions,
        auto_checkpoint_steps=args.auto_checkpoint_steps,
        sampler_slots=args.sampler_slots,
        sampler_max_len=args.sampler_max_len,
    )
