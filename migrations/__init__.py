"""Alembic environment and versions for treadle's database.

Run through :func:`treadle.server.db.session.upgrade_to_head`; the Alembic
``Config`` is built in code from this package's directory, so no alembic.ini is
needed on disk.
"""
