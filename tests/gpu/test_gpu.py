"""The engine on a GPU (``tests/gpu/checks.py``): marked ``gpu``, skipped without
CUDA. ``TREADLE_TEST_DEVICE=cpu`` runs the same checks on the CPU (they are not
part of the default run that way)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.gpu.checks import CHECKS, Ctx, device_under_test
from treadle.workers.model.tiny import build_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    work = tmp_path_factory.mktemp("gpu")
    model = build_tiny_model(work / "tiny", preset="tiny", seed=0)
    return Ctx(device=device_under_test(), model_dir=model, work=work)


@pytest.mark.parametrize(
    ("check", "kwargs"),
    [pytest.param(fn, kwargs, id=name) for name, fn, kwargs in CHECKS],
)
def test_engine_on_the_device(
    ctx: Ctx, check: Callable[..., str], kwargs: dict[str, object]
) -> None:
    print(check(ctx, **kwargs))
