"""Fixtures the unit suites share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from treadle.server.db import make_engine, make_session_factory, upgrade_to_head


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    """A session on a fresh SQLite database migrated to head."""
    engine = make_engine(f"sqlite:///{tmp_path / 'treadle.db'}")
    upgrade_to_head(engine)
    with make_session_factory(engine)() as s:
        yield s
    engine.dispose()
