"""Engines, sessions and schema upgrades.

The schema is made and changed only by Alembic, run in code: the ``Config`` is
built here from the ``treadle.migrations`` package, so an installed server needs
no alembic.ini. To write a new revision against a dev database::

    from alembic import command
    command.revision(alembic_config("sqlite:///dev.db"), "add x", autogenerate=True)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

import treadle.migrations
from treadle.errors import InvalidArgumentError

SUPPORTED_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg")


def parse_database_url(url: str | URL) -> URL:
    """Parse and check a database URL, naming what to write instead when it is wrong."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InvalidArgumentError(
            f"database_url: cannot parse {str(url)!r} as a database URL ({exc}); "
            "expected e.g. sqlite:///path/to/treadle.db or "
            "postgresql+psycopg://user@host:5432/dbname"
        ) from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() in ("postgres", "postgresql"):
        if parsed.drivername != "postgresql+psycopg":
            raise InvalidArgumentError(
                f"database_url: {shown!r} does not select the psycopg 3 driver; "
                "write postgresql+psycopg://... instead"
            )
    elif parsed.drivername not in SUPPORTED_DRIVERS:
        raise InvalidArgumentError(
            f"database_url: unsupported database {parsed.drivername!r} in {shown!r}; "
            "use sqlite:///path or postgresql+psycopg://..."
        )
    return parsed


def _sqlite_on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the one writer
    # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit costs
    # a write() instead of an fsync (~10 ms on a busy disk; the ops log writes two
    # per call). A crashed process loses nothing; a power cut may lose the last
    # commits, never consistency.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str | URL, *, echo: bool = False) -> Engine:
    parsed = parse_database_url(url)
    if parsed.get_backend_name() == "sqlite":
        # The gRPC server hands sessions across threads; SQLite serialises writes itself.
        engine = create_engine(parsed, echo=echo, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    return create_engine(parsed, echo=echo, pool_pre_ping=True)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # Rows stay readable after commit, so handlers can convert them to domain objects.
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config(url: str | URL | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(treadle.migrations.__file__).parent))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        # ConfigParser interpolates '%': escape it (URL-encoded passwords contain it).
        rendered = make_url(url).render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


def _run_with_connection(
    url_or_engine: str | URL | Engine, fn: Callable[[Config, str], None], revision: str
) -> None:
    owned = not isinstance(url_or_engine, Engine)
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
    try:
        with engine.connect() as connection:
            cfg = alembic_config()
            cfg.attributes["connection"] = connection
            fn(cfg, revision)
            connection.commit()
    finally:
        if owned:
            engine.dispose()


def upgrade_to_head(url_or_engine: str | URL | Engine) -> None:
    """Bring the database to the newest schema; a no-op when it is already there."""
    _run_with_connection(url_or_engine, command.upgrade, "head")


def downgrade(url_or_engine: str | URL | Engine, revision: str) -> None:
    """Step the schema back to ``revision`` (``"base"`` drops every table)."""
    _run_with_connection(url_or_engine, command.downgrade, revision)
