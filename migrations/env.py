"""Alembic environment for treadle.

The connection comes from ``config.attributes["connection"]`` (how
``treadle.server.db.session`` runs it) or from the ``sqlalchemy.url`` option.
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlalchemy import Connection

from treadle.common.db.engine import make_engine
from treadle.common.db.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # Autogenerate writes plain SQLAlchemy types, so revisions never import the models.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _run_migrations(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch mode rebuilds SQLite tables (copy, drop, rename); with foreign keys
        # enforced the drop would fail or cascade. The pragma is ignored inside a
        # transaction, so it is set and committed before Alembic begins one.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    try:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=sqlite,
            compare_type=True,
            render_item=_render_item,
        )
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def run_migrations_offline() -> None:
    """Write the SQL instead of running it (``alembic upgrade --sql``)."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_migrations(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: set config.attributes['connection'] or sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _run_migrations(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
