"""Database engines and sessions: the URLs treadle accepts (SQLite, PostgreSQL over
psycopg 3) and the connection settings each needs.

The server and the workers both open the database through these; the schema is
made and changed only by the server's Alembic upgrades (``treadle.server.db``).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

from treadle.errors import InvalidArgumentError

SUPPORTED_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg")


def shown_url(url: str | URL) -> str:
    """``url`` as it may be printed or logged: its password replaced by ``***``."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(a database URL that does not parse)"


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
