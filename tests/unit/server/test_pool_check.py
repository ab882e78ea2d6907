"""A distributed server's refusal of a new ``pool`` sampler (``CeleryDispatcher.
check_placement``) goes by the workers table read now, not by the liveness pass's
list (up to ``check_s`` old): a sampler worker that has registered is never refused
for not being seen yet, and one that has not is refused, naming the base."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from treadle.common.db import workers as wq
from treadle.common.engine.domain import SamplerTarget
from treadle.errors import UnavailableError
from treadle.server.celery.dispatch import CeleryDispatcher
from treadle.server.celery.liveness import Liveness
from treadle.server.celery.placement import Placement
from treadle.server.celery.pool import SamplerPool
from treadle.server.db import make_engine, make_session_factory, upgrade_to_head


def test_a_registered_sampler_worker_not_yet_seen_is_not_refused(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'treadle.db'}")
    upgrade_to_head(engine)
    sessions = make_session_factory(engine)
    placement = Placement(sessions, 15.0, lambda w: False)
    pool = SamplerPool(placement, cast(Any, None), dict, sessions, None, "colocated")
    liveness = Liveness(sessions, placement, cast(Any, None), worker_timeout_s=15.0, check_s=60)
    dispatcher = cast(CeleryDispatcher, SimpleNamespace(pool=pool, liveness=liveness))
    target = SamplerTarget("tiny", placement="pool")
    try:
        with pytest.raises(UnavailableError, match="no sampler worker serves base model 'tiny'"):
            CeleryDispatcher.check_placement(dispatcher, target)
        # a sampler worker registers after the last liveness pass (none runs here)
        with sessions() as s:
            wq.register_worker(
                s, "w-pool", hostname="h", base_models=["tiny"], capacity=1, role="sampler"
            )
            s.commit()
        assert placement.live == []
        CeleryDispatcher.check_placement(dispatcher, target)  # read now: served
        assert [w.worker_id for w in placement.live] == ["w-pool"]
        # another base stays refused
        with pytest.raises(UnavailableError, match="base model 'big'"):
            CeleryDispatcher.check_placement(dispatcher, SamplerTarget("big", placement="pool"))
        CeleryDispatcher.check_placement(dispatcher, SamplerTarget("big"))  # no choice: no check
    finally:
        engine.dispose()
