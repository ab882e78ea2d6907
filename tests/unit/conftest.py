"""Fixtures the unit suites share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy.orm import Session

from treadle.server.db import make_engine, make_session_factory, upgrade_to_head

if TYPE_CHECKING:
    from treadle.workers.engine.base_models import BaseModel
    from treadle.workers.engine.versions import WeightSnapshot


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    """A session on a fresh SQLite database migrated to head."""
    engine = make_engine(f"sqlite:///{tmp_path / 'treadle.db'}")
    upgrade_to_head(engine)
    with make_session_factory(engine)() as s:
        yield s
    engine.dispose()


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> BaseModel:
    """The tiny base model in float32, loaded once a module."""
    import torch

    from treadle.workers.engine.base_models import BaseModelRegistry

    return BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)


@pytest.fixture(scope="module")
def base_snap(base: BaseModel) -> WeightSnapshot:
    """Version 0 of the base: what a sampler samples the base model from."""
    from treadle.workers.engine.versions import WeightSnapshot

    return WeightSnapshot(None, 0, base.params, None)
