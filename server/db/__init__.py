"""Storage: SQLAlchemy rows, engines and sessions, Alembic upgrades, query functions.

Handlers open a session from :func:`make_session_factory`, call the functions in
:mod:`treadle.server.db.queries`, and commit; the schema comes only from
:func:`upgrade_to_head`.
"""

from treadle.common.db.engine import make_engine, make_session_factory

from .session import downgrade, upgrade_to_head

__all__ = ["downgrade", "make_engine", "make_session_factory", "upgrade_to_head"]
