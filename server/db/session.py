"""Schema upgrades (engines and sessions: ``treadle.common.db.engine``).

The schema is made and changed only by Alembic, run in code: the ``Config`` is
built here from the ``treadle.migrations`` package, so an installed server needs
no alembic.ini. To write a new revision against a dev database::

    from alembic import command
    command.revision(alembic_config("sqlite:///dev.db"), "add x", autogenerate=True)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Engine, make_url

import treadle.migrations
from treadle.common.db.engine import make_engine


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
