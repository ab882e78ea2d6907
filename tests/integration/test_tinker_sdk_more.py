"""More of the official ``tinker`` SDK (0.38.0), unmodified, against ``treadle serve``:
GSPO, weights-only loads, copy_weights, checkpoint management, sessions and the
methods the first file leaves out. One embedded server for the module (tiny model).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402

from tests.integration.test_tinker_sdk import BASE, SFT  # noqa: E402
from tests.integration.test_tinker_sdk import sc as _sc_fixture  # noqa: E402,F401 (the fixtures)
from tests.integration.test_tinker_sdk import world as _world_fixture  # noqa: E402,F401


def _policy_datum(tokens: list[int], behaviour: float, adv: list[float]) -> T.Datum:
    n = len(tokens) - 1
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
            "logprobs": T.TensorData.from_numpy(np.full(n, behaviour, np.float32)),
            "advantages": T.TensorData.from_numpy(np.asarray(adv, np.float32)),
        },
    )


def test_gspo_through_the_sdk_matches_the_documented_formula(sc: tinker.ServiceClient) -> None:
    """The loss the server reports for gspo equals tinker's GSPO-token formula
    computed here on the logprobs ``forward`` returns for the same weights."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    data = [
        _policy_datum([1, 5, 9, 13, 17], -2.0, [1.0, 1.0, 1.0, 1.0]),
        _policy_datum([1, 7, 11, 2], -2.5, [-0.5, -0.5, -0.5]),
    ]
    fwd = tc.forward(data, "cross_entropy").result()
    low, high = 0.9, 1.1
    expected = 0.0
    for datum, out in zip(data, fwd.loss_fn_outputs, strict=True):
        lp = out["logprobs"].to_numpy().astype(np.float64)
        q = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
        adv = datum.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
        ratio = np.exp(np.mean(lp - q))
        expected += float(np.sum(-np.minimum(ratio * adv, np.clip(ratio, low, high) * adv)))
    got = tc.forward_backward(
        data, "gspo", loss_fn_config={"clip_low_threshold": low, "clip_high_threshold": high}
    ).result()
    assert got.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def _steps(tc: tinker.TrainingClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(tc.forward_backward(SFT, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(T.AdamParams(learning_rate=2e-2)).result()
    return out


def test_weights_only_load_starts_fresh_adam_moments(sc: tinker.ServiceClient) -> None:
    """load_state / create_training_client_from_state load the weights only: both
    start where the checkpoint is and then step alike (fresh Adam moments), unlike
    the _with_optimizer copy, which carries the saved moments on."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=21).result()
    _steps(tc, 2)
    path = tc.save_state("wo").result().path
    at_save = tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"]

    fresh_copy = sc.create_training_client_from_state(path).result()
    loaded = sc.create_lora_training_client(base_model=BASE, rank=4, seed=99).result()
    loaded.load_state(path).result()
    with_moments = sc.create_training_client_from_state_with_optimizer(path).result()

    a, b, c = _steps(fresh_copy, 2), _steps(loaded, 2), _steps(with_moments, 2)
    assert a[0] == pytest.approx(at_save, rel=1e-6)
    assert b[0] == pytest.approx(at_save, rel=1e-6)
    assert a[1] == pytest.approx(b[1], rel=1e-6)  # the same fresh-Adam step
    assert a[1] != pytest.approx(c[1], rel=1e-4)  # the saved moments move differently


def test_async_weights_only_variants(sc: tinker.ServiceClient) -> None:
    async def run() -> None:
        tc = await sc.create_lora_training_client_async(base_model=BASE, rank=2, seed=8)
        path = (await tc.save_state("wo-async")).path
        other = await sc.create_training_client_from_state_async(path)
        assert (await other.get_info_async()).model_data.model_name == BASE
        await (await other.load_state_async(path)).result_async()

    asyncio.run(run())
