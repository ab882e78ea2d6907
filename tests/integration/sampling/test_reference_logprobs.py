"""``forward_logprobs(reference="treadle://...")``: logprobs under a state or a kept
version the tenant owns, the KL reference after a supervised warm-up.

The reference must equal those weights exactly (the state loaded as a model of
its own), leave the training model exactly as it was (weights, gradients,
optimizer state), be read once per model however often a loop asks, and keep
tenants apart (another tenant's path answers like a path that does not exist).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import make_server
from tests.helpers import tenant_key
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.rl.kl import kl_k3
from treadle.server.embedded import EmbeddedServer

TEXTS = ("3+4=7", "9+9=18", "5+0=5", "2+7=9")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    models = {"tiny": tiny_model_dir, "other": tiny_model_dir}  # "other": another base name
    server = make_server(tmp_path_factory.mktemp("reference"), models)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: EmbeddedServer) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as c:
        yield c


def _other_tenant(srv: EmbeddedServer) -> str:
    return tenant_key(srv, "mallory")


def _data(client: treadle.ServiceClient) -> list[treadle.Datum]:
    tok = client.get_tokenizer("tiny")
    out = []
    for text in TEXTS:
        ids = [tok.bos_token_id, *tok.encode(text), tok.eos_token_id]
        out.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1)},
            )
        )
    return out


def _lp(tc: treadle.TrainingClient, data: list[treadle.Datum], **kw: object) -> np.ndarray:
    out = tc.forward_logprobs(data, **kw).result()  # type: ignore[arg-type]
    return np.concatenate(
        [np.asarray(o["logprobs"], dtype=np.float64) for o in out.loss_fn_outputs]
    )


def _warm_up(tc: treadle.TrainingClient, data: list[treadle.Datum], steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward(data)
        tc.optim_step(treadle.AdamParams(learning_rate=1e-2))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_reference_is_the_saved_state_and_leaves_the_model_alone(
    client: treadle.ServiceClient, srv: EmbeddedServer, full: bool
) -> None:
    data = _data(client)
    make = (
        (lambda: client.create_training_client("tiny", seed=4))
        if full
        else (lambda: client.create_lora_training_client("tiny", rank=4, seed=4))
    )
    tc = make()
    _warm_up(tc, data, steps=4)
    warm = tc.save_state("warm").result().path
    at_warm = _lp(tc, data)

    # Right after the warm-up the reference is the policy itself: KL = 0.
    ref = _lp(tc, data, reference=warm)
    np.testing.assert_allclose(ref, at_warm, atol=1e-6, rtol=0)
    assert float(kl_k3(at_warm, ref).mean()) < 1e-9
    base = _lp(tc, data, reference=True)
    assert float(kl_k3(at_warm, base).mean()) > 1e-3  # the base is far: it was the old reference

    # Train on; the reference stays the warm-up's end, equal to that state loaded
    # as a model of its own.
    _warm_up(tc, data, steps=2)
    loaded = client.create_training_client_from_state(warm)
    np.testing.assert_allclose(_lp(tc, data, reference=warm), _lp(loaded, data), atol=1e-6, rtol=0)
    assert np.abs(_lp(tc, data) - at_warm).max() > 1e-3

    # The call touches neither weights, gradients nor optimizer state: a twin that
    # makes the same calls without it ends up with the same weights.
    twin = client.create_training_client_from_state(tc.save_state("fork").result().path)
    for model, asks in ((tc, True), (twin, False)):
        model.forward_backward(data).result()
        if asks:
            _lp(model, data, reference=warm)
        model.optim_step(treadle.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(_lp(tc, data), _lp(twin, data), atol=1e-6, rtol=0)

    # Read once, however often the loop asks.
    engine_model = srv.ctx.dispatcher.engine.models[tc.model_id]  # type: ignore[union-attr]
    loads = engine_model.references.loads
    for _ in range(3):
        _lp(tc, data, reference=warm)
    assert engine_model.references.loads == loads == 1


def test_a_kept_version_is_a_reference(client: treadle.ServiceClient) -> None:
    data = _data(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=5)
    _warm_up(tc, data, steps=2)
    version = tc.sync_weights().version
    at_sync = _lp(tc, data)
    _warm_up(tc, data, steps=1)
    ref = _lp(tc, data, reference=f"treadle://{tc.model_id}/v/{version}")
    np.testing.assert_allclose(ref, at_sync, atol=1e-6, rtol=0)


def test_bad_and_foreign_references(client: treadle.ServiceClient, srv: EmbeddedServer) -> None:
    data = _data(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=6)
    _warm_up(tc, data, steps=1)
    mine = tc.save_state("mine").result().path
    before = _lp(tc, data)

    with treadle.ServiceClient(srv.address, api_key=_other_tenant(srv)) as other:
        theirs = other.create_lora_training_client("tiny", rank=4)
        # Mine, seen from another tenant, answers exactly like a state that never existed.
        with pytest.raises(NotFoundError) as foreign:
            theirs.forward_logprobs(data, reference=mine).result()
        missing = mine.replace(tc.model_id, "m-doesnotexist")
        with pytest.raises(NotFoundError) as absent:
            theirs.forward_logprobs(data, reference=missing).result()
        assert str(foreign.value).replace(tc.model_id, "m-doesnotexist") == str(absent.value)
        assert "reference_path" in str(foreign.value)
        with pytest.raises(NotFoundError, match="reference_path"):
            theirs.forward_logprobs(data, reference=f"treadle://{tc.model_id}/v/1").result()

    with pytest.raises(InvalidArgumentError, match="reference_path"):
        tc.forward_logprobs(data, reference="s3://bucket/warm").result()
    with pytest.raises(NotFoundError, match="reference_path"):
        tc.forward_logprobs(data, reference=f"treadle://{tc.model_id}/state/nope").result()
    with pytest.raises(NotFoundError, match="reference_path"):
        tc.forward_logprobs(data, reference=f"treadle://{tc.model_id}/v/99").result()
    with pytest.raises(InvalidArgumentError, match="reference"):
        tc.forward_logprobs(data, reference="").result()
    # Refused calls took their seq_ids and changed nothing; the model goes on.
    np.testing.assert_array_equal(_lp(tc, data), before)


def test_kl_to_the_warm_up_is_zero_right_after_it(client: treadle.ServiceClient) -> None:
    """docs/losses.md's recipe: the warm-up's state as ``ref_logprobs`` of a KL-penalised loss."""
    data = _data(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=7)
    _warm_up(tc, data, steps=4)
    warm = tc.save_state("warm-up").result().path
    own = tc.forward_logprobs(data).result().loss_fn_outputs

    def kl_ref(reference: bool | str) -> float:
        ref = tc.forward_logprobs(data, reference=reference).result().loss_fn_outputs
        datums = [
            treadle.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "logprobs": o["logprobs"],
                    "advantages": np.zeros(len(o["logprobs"])),
                    "ref_logprobs": r["logprobs"],
                },
            )
            for d, o, r in zip(data, own, ref, strict=True)
        ]
        out = tc.forward_backward(datums, "ppo", {"kl_beta": 0.05}).result()
        return out.metrics["kl_ref:mean"]

    assert kl_ref(warm) < 1e-9
    assert kl_ref(True) > 1e-3  # the base model: the penalty would fight the warm-up


def test_a_reference_of_another_base_is_invalid(client: treadle.ServiceClient) -> None:
    data = _data(client)
    tc = client.create_lora_training_client("tiny", rank=4, seed=8)
    other = client.create_lora_training_client("other", rank=4, seed=8)
    _warm_up(other, data, steps=1)
    state = other.save_state("s").result().path
    version = f"treadle://{other.model_id}/v/{other.sync_weights().version}"
    for path in (state, version):
        with pytest.raises(InvalidArgumentError, match="reference_path.*'other'"):
            tc.forward_logprobs(data, reference=path).result()


def test_a_state_in_an_s3_store_is_a_reference(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With checkpoints in S3 the engine gets the state downloaded (``workers.engine.staging``)."""
    from tests.integration.services import moto_s3

    with moto_s3("reference") as endpoint:
        srv = make_server(
            tmp_path,
            {"tiny": tiny_model_dir},
            store="s3://reference/ckpt",
            s3_endpoint_url=endpoint,
        )
        try:
            with treadle.ServiceClient(srv.address, api_key=srv.api_key) as c:
                data = _data(c)
                tc = c.create_lora_training_client("tiny", rank=4, seed=9)
                _warm_up(tc, data, steps=2)
                warm = tc.save_state("warm").result().path
                at_warm = _lp(tc, data)
                _warm_up(tc, data, steps=1)
                for _ in range(2):
                    np.testing.assert_allclose(
                        _lp(tc, data, reference=warm), at_warm, atol=1e-6, rtol=0
                    )
                with pytest.raises(NotFoundError, match="reference_path"):
                    tc.forward_logprobs(
                        data, reference=f"treadle://{tc.model_id}/state/no"
                    ).result()
                np.testing.assert_allclose(
                    _lp(tc, data, reference=warm), at_warm, atol=1e-6, rtol=0
                )
        finally:
            srv.stop()
