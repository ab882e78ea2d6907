"""A sweep through the service: N LoRA runs of one tenant driven by
``treadle.rl.sweep_loop`` from one thread, their training calls sharing passes
(``ServerInfo.training_pass_metrics``); more runs than the tenant's model
quota are refused before any is created."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import treadle
from tests.conftest import make_server
from treadle import rl
from treadle.errors import InvalidArgumentError, ResourceExhaustedError
from treadle.server.embedded import EmbeddedServer

QUOTA = 4


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    srv = make_server(
        tmp_path_factory.mktemp("sweep"), {"tiny": tiny_model_dir}, quota_max_models=QUOTA
    )
    yield srv
    srv.stop()


def prompts() -> Iterator[rl.Prompt]:
    for i in itertools.count():
        yield rl.Prompt(tokens=[1, 5 + i % 7, 9], task=i % 2)


def reward(task: Any, seq: treadle.SampledSequence) -> float:
    return float(sum(seq.tokens) % 2 == task)


def test_a_sweep_runs_from_one_thread_and_shares_passes(server: EmbeddedServer) -> None:
    lrs = [1e-3, 3e-3, 1e-2, 3e-2]
    with treadle.ServiceClient(server.address, api_key=server.api_key) as service:
        runs = rl.create_runs(
            service, "tiny", [rl.RunSpec(rank=(8, 16)[i % 2], seed=i) for i in range(len(lrs))]
        )
        steps = [rl.grpo_train_step(adam=treadle.AdamParams(learning_rate=lr)) for lr in lrs]
        threads = threading.active_count()
        history = list(
            rl.sweep_loop(
                runs,
                prompts(),
                reward,
                steps=3,
                groups_per_step=4,
                group_size=4,
                sampling_params=treadle.SamplingParams(max_tokens=3, temperature=1.0),
                train_steps=steps,
                timeout=60.0,
            )
        )
        assert threading.active_count() < threads + len(lrs)  # no thread per run
        assert [len(h) for h in history] == [len(lrs)] * 3
        for i, run in enumerate(runs):
            per_run = [h[i] for h in history]
            assert [s.step for s in per_run] == [1, 2, 3]
            trained = sum(s.metrics.get("trained_rollouts", 0.0) > 0 for s in per_run)
            assert per_run[-1].version == run.get_info().version == trained
        (m,) = [
            p for p in service.get_server_info().training_pass_metrics if p.base_model == "tiny"
        ]
        assert m.calls_batched + m.calls_alone == m.passes - m.batched_passes + m.calls_batched
        # over gRPC the calls arrive one by one: some start alone, the rest batch
        assert m.batched_passes >= 1 and m.calls_per_batched_pass >= 2.0, m
        for run in runs:
            service.delete_model(run.model_id)


def test_a_sweep_over_the_model_quota_is_refused_before_any_model_is_created(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with treadle.ServiceClient(server.address, api_key=server.api_key) as service:
        kept = service.create_lora_training_client("tiny", rank=4)
        info = service.get_server_info()
        assert (info.max_models, info.live_models) == (QUOTA, 1)
        created: list[int] = []
        real_create = service.create_lora_training_client

        def counting_create(*args: Any, **kwargs: Any) -> treadle.TrainingClient:
            created.append(1)
            return real_create(*args, **kwargs)

        monkeypatch.setattr(service, "create_lora_training_client", counting_create)
        with pytest.raises(ResourceExhaustedError, match=f"max_models.*quota of {QUOTA}") as err:
            rl.create_runs(service, "tiny", [rl.RunSpec(rank=4, seed=i) for i in range(QUOTA)])
        assert f"a sweep of {QUOTA} runs" in str(err.value)
        assert f"{QUOTA - 1} more fit" in str(err.value)
        assert created == []  # refused up front: not one model made (and deleted)
        assert service.get_server_info().live_models == 1
        runs = rl.create_runs(
            service, "tiny", [rl.RunSpec(rank=4, seed=i) for i in range(QUOTA - 1)]
        )
        assert len(created) == QUOTA - 1
        assert service.get_server_info().live_models == QUOTA
        for run in [kept, *runs]:
            service.delete_model(run.model_id)
        assert service.get_server_info().live_models == 0


def test_a_sweep_refused_midway_keeps_nothing(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that does not report the quota (or another client of the tenant
    creating models meanwhile): the refusal comes at a creation, and the models
    made before it are deleted."""
    with treadle.ServiceClient(server.address, api_key=server.api_key) as service:
        real_info = service.get_server_info
        monkeypatch.setattr(
            service, "get_server_info", lambda: dataclasses.replace(real_info(), max_models=0)
        )
        before = {m.model_id for m in service.list_models() if m.status == "active"}
        with pytest.raises(ResourceExhaustedError, match=f"max_models.*quota is {QUOTA}") as info:
            rl.create_runs(service, "tiny", [rl.RunSpec(rank=4, seed=i) for i in range(QUOTA + 2)])
        assert f"a sweep of {QUOTA + 2} runs" in str(info.value)
        after = {m.model_id for m in service.list_models() if m.status == "active"}
        assert after == before  # the runs made before the refusal were deleted
        with pytest.raises(InvalidArgumentError, match="runs"):
            rl.create_runs(service, "tiny", [])
