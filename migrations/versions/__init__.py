"""Alembic revisions, one file per schema change (Alembic loads them by path)."""
