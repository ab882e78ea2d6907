"""The service layer without any transport: the ordered-call pipeline, tenant
walls and quotas, called directly with domain types on an in-process engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    SampleOp,
    SamplingConfig,
)
from treadle.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from treadle.server.app import create_context
from treadle.server.config import ServerConfig
from treadle.server.context import ServerContext
from treadle.server.db import queries, tenancy
from treadle.server.service import CallHandle, Service
from treadle.server.service.types import NewModel, OrderedCall, SamplerSource

T = TypeVar("T")
BASE = "tiny"
MAX_TOKENS_PER_REQUEST = 64


@dataclass
class World:
    loop: asyncio.AbstractEventLoop
    ctx: ServerContext
    a: str  # tenant ids
    b: str

    @property
    def service(self) -> Service:
        return self.ctx.service

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp("service") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        threads=1,
        quota_tokens_per_request=MAX_TOKENS_PER_REQUEST,
    )
    loop = asyncio.new_event_loop()
    ctx = loop.run_until_complete(create_context(config))
    with ctx.session() as s:
        a, b = queries.ensure_tenant(s, "a").id, queries.ensure_tenant(s, "b").id
    yield World(loop, ctx, a, b)
    ctx.dispatcher.close()
    loop.close()


def _op(n: int = 8, shift: int = 0) -> ForwardBackwardOp:
    tokens = np.array([1 + (i + shift) % 60 for i in range(n + 1)], dtype=np.int64)
    datum = DatumData(
        tokens=tokens[:-1],
        inputs={"target_tokens": tokens[1:], "weights": np.ones(n, dtype=np.float32)},
    )
    return ForwardBackwardOp(data=(datum,), loss_fn="cross_entropy", loss_config={})


def _call(model_id: str, seq_id: int, digest: str = "d") -> OrderedCall:
    return OrderedCall(model_id=model_id, seq_id=seq_id, digest=f"{digest}-{seq_id}")


def _model(w: World, tenant: str) -> str:
    info = w.run(w.service.models.create(tenant, NewModel(base_model=BASE, lora_rank=2)))
    return info.model_id


def _calls_counted(w: World, tenant: str, model_id: str) -> int:
    assert w.ctx.usage is not None
    w.service.op_endings.flush()  # the ends of calls count them
    delta = w.ctx.usage.pending().get((tenant, model_id, ""))
    return 0 if delta is None else delta.calls


def test_a_repeated_seq_id_is_applied_and_counted_once(world: World) -> None:
    w, training = world, world.service.training
    model = _model(w, w.a)
    first = w.run(training.forward_backward(w.a, _call(model, 1), _op()))
    again = w.run(training.forward_backward(w.a, _call(model, 1), _op()))
    assert again.metrics == first.metrics
    assert _calls_counted(w, w.a, model) == 1
    assert w.service.models.info(w.a, model).next_seq_id == 2
    # the same seq_id with another payload is refused, and changes nothing
    with pytest.raises(FailedPreconditionError):
        w.run(training.forward_backward(w.a, _call(model, 1, "other"), _op(shift=3)))
    step = w.run(training.optim_step(w.a, _call(model, 2), AdamConfig(learning_rate=1e-3)))
    assert step.step == 1
    assert w.service.models.info(w.a, model).version == 1


def test_bad_input_takes_its_seq_id(world: World) -> None:
    w, training = world, world.service.training
    model = _model(w, w.a)
    with pytest.raises(InvalidArgumentError, match="adam_params"):
        w.run(training.optim_step(w.a, _call(model, 1), InvalidArgumentError("adam_params: x")))
    # the next call does not wait for seq_id 1
    w.run(training.forward_backward(w.a, _call(model, 2), _op()))
    assert w.service.models.info(w.a, model).next_seq_id == 3
    with pytest.raises(InvalidArgumentError, match="seq_id"):
        w.run(training.forward_backward(w.a, _call(model, 0), _op()))


def test_another_tenants_ids_are_not_found(world: World) -> None:
    w, svc = world, world.service
    model = _model(w, w.a)
    saved = w.run(svc.training.save_state(w.a, _call(model, 1), "s1"))
    sampler = w.run(svc.sampling.create_sampler(w.a, SamplerSource(base_model=BASE)))

    def not_found(coro: Coroutine[Any, Any, Any]) -> str:
        with pytest.raises(NotFoundError) as err:
            w.run(coro)
        return str(err.value)

    async def sync(fn: Any, *args: Any) -> Any:
        return fn(*args)

    # another tenant's model answers exactly like one that does not exist
    for model_id in (model, "m-missing"):
        messages = {
            not_found(svc.training.forward_backward(w.b, _call(model_id, 2), _op())),
            not_found(sync(svc.models.info, w.b, model_id)),
            not_found(sync(svc.checkpoints.list, w.b, model_id)),
            not_found(svc.models.delete(w.b, model_id)),
        }
        assert messages == {f"NOT_FOUND: model {model_id!r} not found"}
    assert "not found" in not_found(sync(svc.checkpoints.delete, w.b, saved.path))
    assert "not found" in not_found(svc.models.create(w.b, NewModel(from_state=saved.path)))
    assert "not found" in not_found(
        svc.sampling.create_sampler(w.b, SamplerSource(weights=f"treadle://{model}/latest"))
    )
    prompt = SampleOp(np.array([1, 2, 3]), 1, SamplingConfig(max_tokens=2))
    assert "not found" in not_found(svc.sampling.sample(w.b, sampler.sampler_id, prompt))
    assert [m.model_id for m in svc.models.list(w.b)] == []
    session = svc.sessions.create(w.a, "test")
    assert "not found" in not_found(sync(svc.sessions.heartbeat, w.b, session.session_id))
    svc.sessions.heartbeat(w.a, session.session_id)
    # the owner still sees and uses all of it
    assert model in [m.model_id for m in svc.models.list(w.a)]
    assert w.run(svc.sampling.sample(w.a, sampler.sampler_id, prompt)).sequences


def test_quotas_are_resource_exhausted(world: World) -> None:
    w, svc = world, world.service
    with w.ctx.session() as s:
        row = queries.ensure_tenant(s, "quota")
        tenancy.set_quota(s, row, max_models=3)
        tenant = row.id
    model = _model(w, tenant)
    # more tokens than a request may hold: refused, and the seq_id is taken
    with pytest.raises(ResourceExhaustedError):
        w.run(
            svc.training.forward_backward(
                tenant, _call(model, 1), _op(n=MAX_TOKENS_PER_REQUEST + 1)
            )
        )
    w.run(svc.training.forward_backward(tenant, _call(model, 2), _op()))
    # a sample reserves its worst case: the prompt and every sample at max_tokens
    sampler = w.run(svc.sampling.create_sampler(tenant, SamplerSource(base_model=BASE)))
    big = SampleOp(np.array([1, 2, 3]), 4, SamplingConfig(max_tokens=MAX_TOKENS_PER_REQUEST))
    with pytest.raises(ResourceExhaustedError):
        w.run(svc.sampling.sample(tenant, sampler.sampler_id, big))
    _model(w, tenant), _model(w, tenant)  # the third and last the quota allows
    with pytest.raises(ResourceExhaustedError):
        _model(w, tenant)


def test_a_call_handle_is_awaited_without_polling(world: World) -> None:
    w, training = world, world.service.training
    model = _model(w, w.a)

    async def go() -> tuple[float, list[str]]:
        seen: list[str] = []
        handle = CallHandle.start(training.forward_backward, w.a, _call(model, 1), _op())
        handle.add_done_callback(lambda h: seen.append("done"))
        await handle.admitted()
        result = await handle
        return result.metrics["loss:sum"], seen

    loss, seen = w.run(go())
    assert loss > 0 and seen == ["done"]

    async def refused() -> None:
        handle = CallHandle.start(training.forward_backward, w.b, _call(model, 2), _op())
        await handle.admitted()

    with pytest.raises(NotFoundError):
        w.run(refused())

    # a waiter that gives up (an HTTP long poll's timeout) leaves the call running
    async def give_up() -> float:
        handle = CallHandle.start(training.forward_backward, w.a, _call(model, 2), _op())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_await(handle), 0)
        return (await handle).metrics["loss:sum"]

    assert w.run(give_up()) > 0
    assert w.service.models.info(w.a, model).next_seq_id == 3


async def _await(handle: CallHandle[Any]) -> Any:
    return await handle


def test_sampler_cache_stays_bounded(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sync_weights makes a sampler: the server keeps the targets of the
    latest ones only, and reads an older one again from the database."""
    from treadle.server.service import sampling

    w, svc = world, world.service
    monkeypatch.setattr(sampling, "MAX_CACHED_SAMPLERS", 3, raising=False)
    made = [
        w.run(svc.sampling.create_sampler(w.a, SamplerSource(base_model=BASE))).sampler_id
        for _ in range(8)
    ]
    cache = svc.sampling._targets
    assert len(cache) <= 3
    assert made[0] not in cache  # the oldest went first
    # an evicted sampler still resolves, and still only for its tenant
    assert svc.sampling.target(w.a, made[0]).base_model == BASE
    with pytest.raises(NotFoundError):
        svc.sampling.target(w.b, made[1])
    assert len(cache) <= 3


def test_the_sampler_a_sync_makes_is_known_without_a_database_read(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sync_weights's sampler is sampled right after (every RL step): its target
    is kept when it is made, as create_sampler's is, not read back per step."""
    from treadle.server.service import sampling

    w, svc = world, world.service
    model = _model(w, w.a)
    out = w.run(svc.training.sync_weights(w.a, _call(model, 1), sampler="version"))

    def no_read(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the sampler's target was read from the database")

    monkeypatch.setattr(sampling.queries, "get_sampler", no_read)
    target = svc.sampling.target(w.a, out.sampler_id)
    assert (target.model_id, target.version) == (model, out.version)
    with pytest.raises(NotFoundError):  # still the tenant's own
        svc.sampling.target(w.b, out.sampler_id)
