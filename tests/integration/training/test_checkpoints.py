"""Training state on disk: save/load reproduce weights AND optimizer state exactly,
checkpoints are listed, and a restarted server brings each model back at its last
checkpoint (DESIGN: "Committed" means checkpointed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.helpers import char_ids, next_token_datum
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

BASE = "tiny"
TIMEOUT = 30.0


def _config(tmp: Path, model_dir: Path, port: int = 0) -> ServerConfig:
    # one engine thread: two would fight over 2 shared cores
    return ServerConfig(data_dir=tmp / "data", models={BASE: model_dir}, port=port, threads=1)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(_config(tmp_path_factory.mktemp("ckpt"), tiny_model_dir)).start()
    yield srv
    srv.stop()


def _datum(text: str) -> treadle.Datum:
    return next_token_datum(char_ids(text))


TRAIN = [_datum("12+3=15"), _datum("hello world"), _datum("9*9=81")]
PROBE = [_datum("abc+def"), _datum("7*6=42")]


def _step(tc: treadle.TrainingClient, i: int, lr: float = 1e-2) -> treadle.OptimStepResponse:
    tc.forward_backward([TRAIN[i % len(TRAIN)]])
    return tc.optim_step(treadle.AdamParams(learning_rate=lr, weight_decay=0.01)).result(TIMEOUT)


def _lp(tc: treadle.TrainingClient) -> list[np.ndarray]:
    out = tc.forward_logprobs(PROBE).result(timeout=TIMEOUT)
    return [o.logprobs for o in out.loss_fn_outputs]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def _new(service: treadle.ServiceClient, kind: str, seed: int) -> treadle.TrainingClient:
    if kind == "lora":
        return service.create_lora_training_client(BASE, rank=4, seed=seed)
    return service.create_training_client(BASE, seed=seed)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_save_and_load_reproduce_weights_and_optimizer_state(
    service: treadle.ServiceClient, kind: str
) -> None:
    lr = 1e-2 if kind == "lora" else 2e-3
    tc = _new(service, kind, seed=1)
    for i in range(3):
        _step(tc, i, lr)
    saved = tc.save_state(f"{kind}-three").result(timeout=TIMEOUT)
    assert saved.step == 3 and saved.seq_id == 7
    assert saved.path == f"treadle://{tc.model_id}/state/{kind}-three"
    at_save = _lp(tc)

    loaded = _new(service, kind, seed=99)  # other init: everything must come from the file
    assert loaded.load_state(saved.path).result(timeout=TIMEOUT) == 3
    assert loaded.get_info().version == 3
    created = service.create_training_client_from_state(saved.path)
    info = created.get_info()
    assert info.version == 3 and info.is_lora == (kind == "lora") and info.next_seq_id == 1
    for other in (loaded, created):
        _same(_lp(other), at_save)

    # two more identical steps: equal only if Adam's moments and step count (bias
    # correction) came back too
    for i in (3, 4):
        metrics = [_step(m, i, lr).metrics for m in (tc, loaded, created)]
        assert metrics[0] == metrics[1] == metrics[2]
    reference = _lp(tc)
    _same(_lp(loaded), reference)
    _same(_lp(created), reference)
    assert loaded.get_info().version == created.get_info().version == 5

    # the checkpoint is a snapshot: later training of the source does not leak into it
    again = service.create_training_client_from_state(saved.path)
    _same(_lp(again), at_save)


def test_list_checkpoints(service: treadle.ServiceClient) -> None:
    tc = _new(service, "lora", seed=2)
    assert tc.list_checkpoints() == []
    _step(tc, 0)
    first = tc.save_state("first").result(timeout=TIMEOUT)
    _step(tc, 1)
    second = tc.save_state("second").result(timeout=TIMEOUT)
    listed = {c.name: c for c in tc.list_checkpoints()}
    assert set(listed) == {"first", "second"}
    assert (listed["first"].path, listed["first"].seq_id, listed["first"].step) == (
        first.path,
        3,
        1,
    )
    assert (listed["second"].path, listed["second"].seq_id, listed["second"].step) == (
        second.path,
        6,
        2,
    )
    assert all(c.size_bytes > 0 and c.created_at > 0 for c in listed.values())
    # saving under a taken name replaces that checkpoint
    again = tc.save_state("first").result(timeout=TIMEOUT)
    listed = {c.name: c for c in tc.list_checkpoints()}
    assert len(listed) == 2 and listed["first"].seq_id == again.seq_id == 7
    assert tc.get_info().last_checkpoint_seq_id == 7
    other = _new(service, "lora", seed=2)
    assert other.list_checkpoints() == []


def test_restart_brings_models_back_at_their_last_checkpoint(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    srv = EmbeddedServer(_config(tmp_path, tiny_model_dir)).start()
    port = srv.port
    service = treadle.ServiceClient(srv.address)
    try:
        models = {kind: _new(service, kind, seed=5) for kind in ("lora", "full")}
        at_ckpt, after, step_metrics = {}, {}, {}
        for kind, tc in models.items():
            _step(tc, 0, 2e-3)
            saved = tc.save_state("ckpt").result(timeout=TIMEOUT)
            assert saved.seq_id == 3
            at_ckpt[kind] = _lp(tc)  # seq 4
            step_metrics[kind] = _step(tc, 1, 2e-3).metrics  # seqs 5, 6: lost at restart
            after[kind] = _lp(tc)
            assert tc.get_info().next_seq_id == 8
        never_saved = _new(service, "lora", seed=6)
        at_creation = _lp(never_saved)
        _step(never_saved, 0)
        deleted = _new(service, "lora", seed=7)
        service.delete_model(deleted.model_id)
    finally:
        srv.stop()

    srv = EmbeddedServer(_config(tmp_path, tiny_model_dir, port=port)).start()
    try:
        for kind, tc in models.items():
            info = tc.get_info()
            assert info.last_checkpoint_seq_id == 3
            assert info.next_seq_id == 4
            assert info.version == 1
            assert tc.resync() == 4
            _same(_lp(tc), at_ckpt[kind])  # seq 4 again, on the restored weights
            # the same step as before the restart gives the same numbers: the
            # optimizer state came back too
            assert _step(tc, 1, 2e-3).metrics == step_metrics[kind]
            _same(_lp(tc), after[kind])
            assert tc.get_info().version == 2
        info = never_saved.get_info()
        assert (info.version, info.next_seq_id, info.last_checkpoint_seq_id) == (0, 1, 0)
        never_saved.resync()
        _same(_lp(never_saved), at_creation)
        with pytest.raises(treadle.NotFoundError):
            service.get_model_info(deleted.model_id)
        listed = {m.model_id for m in service.list_models()}
        assert {m.model_id for m in models.values()} | {never_saved.model_id} <= listed
    finally:
        service.close()
        srv.stop()


def test_model_created_from_state_survives_a_restart(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A model created from a checkpoint and never saved again comes back with the
    checkpoint's weights, not with a fresh initialisation."""
    srv = EmbeddedServer(_config(tmp_path, tiny_model_dir)).start()
    port = srv.port
    service = treadle.ServiceClient(srv.address)
    try:
        source = _new(service, "lora", seed=8)
        for i in range(2):
            _step(source, i)
        path = source.save_state("seed-state").result(timeout=TIMEOUT).path
        child = service.create_training_client_from_state(path)
        expected = _lp(child)
        child_info = child.get_info()
    finally:
        srv.stop()
    srv = EmbeddedServer(_config(tmp_path, tiny_model_dir, port=port)).start()
    try:
        info = child.get_info()
        assert info.version == child_info.version == 2
        assert info.status == "active"
        child.resync()
        _same(_lp(child), expected)
    finally:
        service.close()
        srv.stop()
