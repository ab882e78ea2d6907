"""The official ``tinker`` SDK (0.38.0), unmodified, against ``treadle serve``'s
HTTP API: supervised and RL loops, the async variants, tenant walls and retries.

One embedded server per module (tiny model, port 0 for both transports);
tenant A is the server's default tenant, B a second one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402

import treadle  # noqa: E402
from tests.helpers import tenant_key  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
BASE = "tiny"


@dataclass
class World:
    server: EmbeddedServer
    url: str
    key_a: str  # as the tinker SDK takes it: tml-<treadle key>
    key_b: str

    def client(self, key: str | None = None) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=key or self.key_a)

    def post(self, route: str, key: str | None, **kw: object) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        headers.update(kw.pop("headers", {}))  # type: ignore[arg-type]
        return httpx.post(f"{self.url}/api/v1/{route}", headers=headers, timeout=60, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tinker")
    config = ServerConfig(
        data_dir=tmp / "data", models={BASE: tiny_model_dir}, port=0, http_port=0, threads=1
    )
    srv = EmbeddedServer(config).start()
    assert srv.api_key and srv.http_url
    yield World(srv, srv.http_url, "tml-" + srv.api_key, "tml-" + tenant_key(srv, "b"))
    srv.stop()


@pytest.fixture(scope="module")
def sc(world: World) -> Iterator[tinker.ServiceClient]:
    client = world.client()
    yield client
    client.close("success").result()


def _sft_datum(tokens: list[int]) -> T.Datum:
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": T.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
        },
    )


SFT = [_sft_datum([1, 5, 9, 13, 17, 21, 25, 2]), _sft_datum([1, 7, 11, 15, 19, 2])]


def test_supervised_loop(sc: tinker.ServiceClient) -> None:
    """(a) cross_entropy, optim_step, forward: the loss falls, forward agrees."""
    caps = sc.create_rest_client().get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    assert tc.get_info().model_data.model_name == BASE
    tokenizer = tc.get_tokenizer()  # a local directory: loads offline
    assert tokenizer.encode("ab")
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(SFT, "cross_entropy").result()
        losses.append(fb.metrics["loss:sum"])
        assert len(fb.loss_fn_outputs) == 2
        assert fb.loss_fn_outputs[0]["logprobs"].shape == [7]
        tc.optim_step(T.AdamParams(learning_rate=5e-2)).result()
    assert losses[-1] < losses[0]
    out = tc.forward(SFT, "cross_entropy").result()
    lp = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
    assert out.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)
    again = tc.forward_backward(SFT, "cross_entropy").result()
    assert again.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)


def _rl_datums(prompt: list[int], seqs: list[T.SampledSequence], adv: np.ndarray) -> list[T.Datum]:
    out = []
    for seq, a in zip(seqs, adv, strict=True):
        tokens = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1
        logprobs = np.concatenate([np.zeros(n_prompt), np.asarray(seq.logprobs)]).astype(np.float32)
        advantages = np.concatenate([np.zeros(n_prompt), np.full(len(seq.tokens), a)]).astype(
            np.float32
        )
        out.append(
            T.Datum(
                model_input=T.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
                    "logprobs": T.TensorData.from_numpy(logprobs),
                    "advantages": T.TensorData.from_numpy(advantages),
                },
            )
        )
    return out


def test_rl_loop(sc: tinker.ServiceClient) -> None:
    """(b) sample from saved weights, importance_sampling and ppo, optim_step."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    prompt = [1, 5, 9, 13]
    params = T.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    for loss in ("importance_sampling", "ppo"):
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(T.ModelInput.from_ints(prompt), 4, params).result()
        assert len(res.sequences) == 4
        for seq in res.sequences:
            assert len(seq.tokens) == len(seq.logprobs) > 0
            assert seq.stop_reason in ("stop", "length")
            assert seq.sequence_id
        rewards = np.asarray([float(len(s.tokens)) for s in res.sequences])
        adv = rewards - rewards.mean()
        data = _rl_datums(prompt, list(res.sequences), adv)
        fb = tc.forward_backward(data, loss).result()
        # samples of the weights being trained: every ratio is 1, the loss -Σ_tokens A
        expected = -sum(len(s.tokens) * a for s, a in zip(res.sequences, adv, strict=True))
        assert fb.metrics["loss:sum"] == pytest.approx(expected, abs=1e-3)
        tc.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    # a named sampler checkpoint, then a sampling client from its path
    path = tc.save_weights_for_sampler("rl-final").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/rl-final")
    sampler = sc.create_sampling_client(model_path=path)
    assert len(sampler.sample(T.ModelInput.from_ints(prompt), 2, params).result().sequences) == 2


def test_compute_logprobs_equals_forward_logprobs(world: World, sc: tinker.ServiceClient) -> None:
    """(d) compute_logprobs of trained weights equals forward_logprobs of the same
    weights (treadle's SDK over gRPC, and the tinker SDK's forward); the top-k
    prompt logprobs and a scored suffix (prompt_logprobs_last_n) in tinker's format."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [1, 5, 9, 13, 17, 21, 25, 7, 3]
    got = sampler.compute_logprobs(T.ModelInput.from_ints(prompt)).result()
    assert len(got) == len(prompt) and got[0] is None
    scored = np.asarray(got[1:], np.float64)
    fwd = tc.forward([_sft_datum(prompt)], "cross_entropy").result()
    np.testing.assert_allclose(scored, fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
    res = sampler.sample(
        T.ModelInput.from_ints(prompt),
        1,
        T.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert res.topk_prompt_logprobs is not None and res.topk_prompt_logprobs[0] is None
    for lp, row in zip(got[1:], res.topk_prompt_logprobs[1:], strict=True):
        assert row is not None and len(row) == 3
        assert lp is not None and lp <= row[0][1] + 1e-5
    last = sampler.compute_logprobs(
        T.ModelInput.from_ints(prompt), prompt_logprobs_last_n=3
    ).result()
    assert last[:-3] == [None] * (len(prompt) - 3)
    np.testing.assert_allclose(np.asarray(last[-3:], np.float64), scored[-3:], atol=1e-6)
    again = asyncio.run(sampler.compute_logprobs_async(T.ModelInput.from_ints(prompt)))
    np.testing.assert_allclose(np.asarray(again[1:], np.float64), scored, atol=1e-6)
    # last: treadle's own forward_logprobs on the same model (it takes the next seq_id)
    with treadle.ServiceClient(world.server.address, api_key=world.key_a[4:]) as client:
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints(prompt[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:]},
        )
        out = client.get_training_client(tc.model_id).forward_logprobs([datum]).result(60)
    np.testing.assert_allclose(scored, out.loss_fn_outputs[0].logprobs, atol=1e-4, rtol=0)


def test_async_variants(sc: tinker.ServiceClient) -> None:
    """(f) the *_async methods, several requests in flight at once."""

    async def run() -> list[float]:
        tc = await sc.create_lora_training_client_async(base_model=BASE, rank=2, seed=5)
        futs = [await tc.forward_backward_async(SFT, "cross_entropy") for _ in range(3)]
        results = [await f.result_async() for f in futs]
        await (await tc.optim_step_async(T.AdamParams(learning_rate=1e-2))).result_async()
        sampler = await tc.save_weights_and_get_sampling_client_async()
        res = await sampler.sample_async(
            T.ModelInput.from_ints([1, 2, 3]), 2, T.SamplingParams(max_tokens=3)
        )
        assert len(res.sequences) == 2
        return [r.metrics["loss:sum"] for r in results]

    losses = asyncio.run(run())
    # three accumulating calls before one step: the same weights, the same loss
    assert losses[0] == pytest.approx(losses[1]) == pytest.approx(losses[2])


def test_save_state_then_continue_from_it_exactly(sc: tinker.ServiceClient) -> None:
    """(c) save_state -> create_training_client_from_state_with_optimizer: the copy
    takes the same next steps as the original (weights and Adam moments restored)."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    for _ in range(2):
        tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(T.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_state("mid").result().path
    assert path.endswith("/weights/mid")
    copy = sc.create_training_client_from_state_with_optimizer(path).result()
    assert copy.get_info().model_data.model_name == BASE
    for _ in range(2):
        a = tc.forward_backward(SFT, "cross_entropy").result().metrics["loss:sum"]
        b = copy.forward_backward(SFT, "cross_entropy").result().metrics["loss:sum"]
        assert a == pytest.approx(b, rel=1e-6)
        tc.optim_step(T.AdamParams(learning_rate=2e-2)).result()
        copy.optim_step(T.AdamParams(learning_rate=2e-2)).result()
    listed = sc.create_rest_client().list_checkpoints(tc.model_id).result()
    assert path in [c.tinker_path for c in listed.checkpoints]


def test_forward_backward_custom_dpo(sc: tinker.ServiceClient) -> None:
    """(e) a DPO-style loss through the SDK's client-side custom-loss path: the
    chosen answer's margin over the rejected one grows."""
    import torch

    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    chosen, rejected = _sft_datum([1, 5, 9, 13, 2]), _sft_datum([1, 5, 8, 12, 2])

    def dpo(data: list[T.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        margin = logprobs[0].sum() - logprobs[1].sum()
        loss = -torch.nn.functional.logsigmoid(0.5 * margin)
        return loss, {"margin": float(margin)}

    margins = []
    for _ in range(3):
        out = tc.forward_backward_custom([chosen, rejected], dpo).result()
        margins.append(out.metrics["margin"])
        tc.optim_step(T.AdamParams(learning_rate=5e-2)).result()
    assert margins[-1] > margins[0]


def test_rest_client_and_the_smaller_methods(sc: tinker.ServiceClient) -> None:
    """Training runs, checkpoints, weights info and samplers through RestClient;
    load_state_with_optimizer; a sampling client's own methods."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    rest = sc.create_rest_client()
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == BASE and run.is_lora and run.lora_rank == 2
    assert tc.model_id in [
        r.training_run_id for r in rest.list_training_runs().result().training_runs
    ]
    path = tc.save_state("rest").result().path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == BASE and info.lora_rank == 2
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    before = tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"]
    tc.load_state_with_optimizer(path).result()  # back to before the step
    restored = tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"]
    assert restored != pytest.approx(before, rel=1e-6)
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [
        c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    ]
    sampler_path = tc.save_weights_for_sampler("rest-s").result().path
    sampler = tc.create_sampling_client(sampler_path)
    assert sampler.get_base_model() == BASE
    assert sampler.get_sampler_handle()  # a handle another process can sample through


def test_readme_tinker_example_runs(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's "Use it from the tinker SDK" example, as written (its model
    name swapped for this server's)."""
    import re

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Use it from the tinker SDK", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its tinker example"
    monkeypatch.setenv("TINKER_BASE_URL", world.url)
    monkeypatch.setenv("TINKER_API_KEY", world.key_a)
    source = match.group(1).replace('"demo"', f'"{BASE}"')
    exec(compile(source, "README.md", "exec"), {"__name__": "readme_tinker"})


def test_more_async_variants_and_rest_calls(world: World, sc: tinker.ServiceClient) -> None:
    """The *_async forms of the checkpoint, sampler and REST methods, in one loop."""
    rest = sc.create_rest_client()

    async def run() -> None:
        tc = await sc.create_lora_training_client_async(base_model=BASE, rank=2, seed=6)
        info = await tc.get_info_async()
        assert info.model_data.model_name == BASE
        out = await (await tc.forward_async(SFT, "cross_entropy")).result_async()
        assert "loss:sum" in out.metrics
        saved = await (await tc.save_state_async("async-state")).result_async()
        await (await tc.load_state_with_optimizer_async(saved.path)).result_async()
        copy = await sc.create_training_client_from_state_with_optimizer_async(saved.path)
        assert (await copy.get_info_async()).model_data.model_name == BASE
        sw = await (await tc.save_weights_for_sampler_async("async-s")).result_async()
        sampler = await tc.create_sampling_client_async(sw.path)
        assert await sampler.get_base_model_async() == BASE
        other = await sc.create_sampling_client_async(base_model=BASE)
        res = await other.sample_async(
            T.ModelInput.from_ints([1, 2]), 1, T.SamplingParams(max_tokens=2)
        )
        assert len(res.sequences) == 1
        run = await rest.get_training_run_async(tc.model_id)
        assert run.base_model == BASE
        runs = await rest.list_training_runs_async()
        assert tc.model_id in [r.training_run_id for r in runs.training_runs]
        listed = await rest.list_checkpoints_async(tc.model_id)
        assert saved.path in [c.tinker_path for c in listed.checkpoints]
        await rest.delete_checkpoint_async(tc.model_id, "weights/async-state")
        listed = await rest.list_checkpoints_async(tc.model_id)
        assert saved.path not in [c.tinker_path for c in listed.checkpoints]
        # a sampler another process opens from the handle
        again = tinker.SamplingClient.from_sampler_handle(
            sampler.get_sampler_handle(), api_key=world.key_a
        )
        assert again.get_base_model() == BASE

    asyncio.run(run())


SDK_LOSSES = [name for name in T.LossFnType.__args__ if name != "custom"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("loss", SDK_LOSSES)
def test_every_sdk_loss(sc: tinker.ServiceClient, loss: str) -> None:
    """Each loss the SDK can send: served ones train; the others are refused
    with a 400 on the request naming the loss, why, and the ones served, after
    which the same TrainingClient goes on training (the refused call took its
    seq_id: the next call does not wait on a gap). The compatibility table lists
    both from this test's results."""
    from treadle.workers.trainer.losses import LOSSES, UNSERVED

    tc = _loss_client(sc)
    tokens = [1, 5, 9, 13, 17]
    n = len(tokens) - 1
    inputs = {"target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64))}
    if loss == "cross_entropy":
        inputs["weights"] = T.TensorData.from_numpy(np.ones(n, np.float32))
    else:
        inputs["logprobs"] = T.TensorData.from_numpy(np.full(n, -2.0, np.float32))
        inputs["advantages"] = T.TensorData.from_numpy(np.linspace(-1, 1, n).astype(np.float32))
    datum = T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
    if loss in LOSSES:
        out = tc.forward_backward([datum], loss).result()
        assert np.isfinite(out.metrics["loss:sum"])
    else:
        assert loss in UNSERVED, f"{loss}: the SDK can send it; say why it is not served"
        with pytest.raises(tinker.BadRequestError, match=f"'{loss}' is not served") as err:
            tc.forward_backward([datum], loss).result()
        assert err.value.status_code == 400
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "INVALID_ARGUMENT"
        assert UNSERVED[loss] in body["error"]
        ce = {
            "target_tokens": inputs["target_tokens"],
            "weights": T.TensorData.from_numpy(np.ones(n, np.float32)),
        }
        again = T.Datum(model_input=datum.model_input, loss_fn_inputs=ce)
        out = tc.forward_backward([again], "cross_entropy").result(timeout=30)
        assert np.isfinite(out.metrics["loss:sum"])


_LOSS_CLIENT: list[tinker.TrainingClient] = []


def _loss_client(sc: tinker.ServiceClient) -> tinker.TrainingClient:
    if not _LOSS_CLIENT:
        _LOSS_CLIENT.append(sc.create_lora_training_client(base_model=BASE, rank=2).result())
    return _LOSS_CLIENT[0]
