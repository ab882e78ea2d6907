"""What running tinker-cookbook against treadle found (issue 40), through the
official ``tinker`` SDK (0.38.0), unmodified: a training run's user_metadata and
fields, ``kind="inflight"`` sampling clients, policy-loss metrics over the right
tokens, and the sampling request's limits; each also over treadle's gRPC SDK where
both transports carry it. One embedded server for the module (tiny model).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402

import treadle  # noqa: E402
from tests.integration.tinker.test_tinker_sdk import BASE, SFT, World, _rl_datums  # noqa: E402
from tests.integration.tinker.test_tinker_sdk import sc as _sc_fixture  # noqa: E402,F401 (the fixtures)
from tests.integration.tinker.test_tinker_sdk import world as _world_fixture  # noqa: E402,F401
from treadle.errors import InvalidArgumentError  # noqa: E402


@pytest.fixture(scope="module")
def world(_world_fixture: World) -> World:  # noqa: F811
    return _world_fixture


@pytest.fixture(scope="module")
def sc(_sc_fixture: tinker.ServiceClient) -> tinker.ServiceClient:  # noqa: F811
    return _sc_fixture


def _grpc(world: World) -> treadle.ServiceClient:
    return treadle.ServiceClient(world.server.address, api_key=world.key_a[4:])


# ---- 1. user_metadata ----------------------------------------------------------------


def test_run_user_metadata_is_kept_listed_and_seen_by_both_sdks(
    world: World, sc: tinker.ServiceClient
) -> None:
    meta = {"renderer_name": "llama3", "note": "issue 40"}
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, user_metadata=meta).result()
    rest = sc.create_rest_client()
    assert rest.get_training_run(tc.model_id).result().user_metadata == meta
    listed = {
        r.training_run_id: r for r in rest.list_training_runs(limit=100).result().training_runs
    }
    assert listed[tc.model_id].user_metadata == meta
    # a run made from a checkpoint (load_weights' new-model branch) keeps its own
    path = tc.save_state("meta").result().path
    assert rest.get_training_run_by_tinker_path(path).result().user_metadata == meta
    copy = sc.create_training_client_from_state(path, user_metadata={"renderer_name": "qwen3"})
    copy_tc = copy.result()
    assert rest.get_training_run(copy_tc.model_id).result().user_metadata == {
        "renderer_name": "qwen3"
    }
    plain = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    assert rest.get_training_run(plain.model_id).result().user_metadata is None
    # gRPC: the same run, and one made there, seen through the other SDK
    with _grpc(world) as client:
        assert client.get_model_info(tc.model_id).user_metadata == meta
        made = client.create_lora_training_client(BASE, rank=2, user_metadata={"k": "v"})
        assert client.get_model_info(made.model_id).user_metadata == {"k": "v"}
        assert rest.get_training_run(made.model_id).result().user_metadata == {"k": "v"}
        with pytest.raises(InvalidArgumentError, match=r"user_metadata: 65 keys; at most 64"):
            client.create_lora_training_client(
                BASE, rank=2, user_metadata={f"k{i}": "v" for i in range(65)}
            )


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({f"k{i}": "v" for i in range(65)}, "user_metadata: 65 keys; at most 64"),
        ({"n": 3}, "user_metadata.n: expected a string, got int"),
        ({"big": "x" * 5000}, "user_metadata.big: 5000 characters; at most 4096"),
        ({f"k{i}": "x" * 4000 for i in range(5)}, "bytes as JSON; at most 16384"),
        ("renderer", "user_metadata: expected an object"),
    ],
)
def test_bad_user_metadata_is_a_400_naming_the_field(
    world: World, sc: tinker.ServiceClient, metadata: object, message: str
) -> None:
    body = {"base_model": BASE, "session_id": "", "model_seq_id": 0, "user_metadata": metadata}
    r = world.post("create_model", world.key_a, json=body)
    assert r.status_code == 400, r.text
    assert message in r.text
    # load_weights' new-model branch checks it the same way
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    path = tc.save_state("bad-meta").result().path
    load = {"path": path, "session_id": "s", "model_seq_id": 99, "user_metadata": metadata}
    r = world.post("load_weights", world.key_a, json=load)
    assert r.status_code == 400 and message in r.text, r.text


# ---- 2. a run's other fields -----------------------------------------------------------


def test_run_last_checkpoints_and_last_request_time(sc: tinker.ServiceClient) -> None:
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    rest = sc.create_rest_client()
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint is None and run.last_sampler_checkpoint is None
    first_request = run.last_request_time
    time.sleep(0.05)
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("fields").result().path
    sampler = tc.save_weights_for_sampler("fields-s").result().path
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_request_time > first_request
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_checkpoint.checkpoint_type == "training"
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert run.last_sampler_checkpoint.checkpoint_type == "sampler"
    assert run.last_sampler_checkpoint.time >= run.last_checkpoint.time
    # a later save is the last one; a forward moves last_request_time on
    time.sleep(0.05)
    again = tc.save_state("fields-2").result().path
    tc.forward(SFT, "cross_entropy").result()
    later = rest.get_training_run(tc.model_id).result()
    assert later.last_checkpoint is not None and later.last_checkpoint.tinker_path == again
    assert later.last_request_time > run.last_request_time
    listed = {
        r.training_run_id: r for r in rest.list_training_runs(limit=100).result().training_runs
    }
    assert listed[tc.model_id].last_checkpoint is not None
    assert listed[tc.model_id].last_checkpoint.tinker_path == again


# ---- 3. kind="inflight" ------------------------------------------------------------------


def _logprobs(sampler: tinker.SamplingClient, tokens: list[int]) -> np.ndarray:
    got = sampler.compute_logprobs(T.ModelInput.from_ints(tokens)).result()
    return np.asarray(got[1:], np.float64)


def test_inflight_clients_share_the_models_one_target(sc: tinker.ServiceClient) -> None:
    """Every inflight client of a model reads one target that a later inflight save
    moves (for the clients made before it too); a snapshot keeps its weights."""
    tokens = [1, 5, 9, 13, 17, 21, 25, 2]
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    before = _logprobs(first, tokens)
    np.testing.assert_allclose(_logprobs(snapshot, tokens), before, atol=1e-6)
    for _ in range(2):
        tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(T.AdamParams(learning_rate=5e-2)).result()
    trained = np.asarray(
        tc.forward(SFT[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy(),
        np.float64,
    )
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    after_first, after_second = _logprobs(first, tokens), _logprobs(second, tokens)
    np.testing.assert_allclose(after_first, after_second, atol=1e-6)
    np.testing.assert_allclose(after_second, trained, atol=1e-4)
    assert np.max(np.abs(after_first - before)) > 1e-3  # the first client moved on
    np.testing.assert_allclose(_logprobs(snapshot, tokens), before, atol=1e-6)
    # sampling through an inflight client works as through any other
    out = first.sample(T.ModelInput.from_ints([1, 5]), 2, T.SamplingParams(max_tokens=3)).result()
    assert len(out.sequences) == 2


def test_an_unknown_sampler_kind_is_a_400_naming_the_field(
    world: World, sc: tinker.ServiceClient
) -> None:
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    body = {"model_id": tc.model_id, "seq_id": 1, "sampling_session_seq_id": 0, "kind": "live"}
    r = world.post("save_weights_for_sampler", world.key_a, json=body)
    assert r.status_code == 400 and "kind: 'live'" in r.text, r.text
    named = {"model_id": tc.model_id, "seq_id": 2, "path": "x", "kind": "inflight"}
    r = world.post("save_weights_for_sampler", world.key_a, json=named)
    assert r.status_code == 400 and "kind: 'inflight'" in r.text, r.text


# ---- 4. metrics over the right tokens ------------------------------------------------------


def test_importance_sampling_metrics_describe_the_completion_on_both_transports(
    world: World, sc: tinker.ServiceClient
) -> None:
    """As the SDK (and the cookbook) sends it: no weights, prompt positions with a
    placeholder logprob 0 and advantage 0. The completion was sampled from the
    weights being trained, so its ratio is 1: ratio:mean says so (it said ≈ 0.2)."""
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    prompt = [1, 5, 9, 13, 17, 21]
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = T.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    seqs = list(sampler.sample(T.ModelInput.from_ints(prompt), 4, params).result().sequences)
    adv = np.asarray([1.0, -1.0, 0.5, -0.5])
    data = _rl_datums(prompt, seqs, adv)
    http = tc.forward_backward(data, "importance_sampling").result().metrics
    assert http["ratio:mean"] == pytest.approx(1.0, abs=2e-3)
    assert http["ratio:min"] == pytest.approx(1.0, abs=5e-3)
    assert http["approx_kl:mean"] == pytest.approx(0.0, abs=1e-4)
    assert http["ntokens:sum"] == sum(len(d.model_input.to_ints()) for d in data)
    # the same datums over gRPC (treadle's SDK, the next seq_id of the same model)
    with _grpc(world) as client:
        same = [
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(d.model_input.to_ints()),
                loss_fn_inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
            )
            for d in data
        ]
        grpc = (
            client.get_training_client(tc.model_id)
            .forward_backward(same, "importance_sampling")
            .result(60)
        )
    assert grpc.metrics["ratio:mean"] == pytest.approx(http["ratio:mean"], abs=1e-6)
    assert grpc.metrics["approx_kl:mean"] == pytest.approx(http["approx_kl:mean"], abs=1e-6)


# ---- 5. a model given as a directory, by its absolute path --------------------------------


def test_served_directory_answers_to_its_absolute_path(
    sc: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    """So a client that loads its tokenizer by the base model's name (tinker-cookbook's
    get_tokenizer(model_name)) can name the directory and stay offline."""
    path = str(tiny_model_dir.resolve())
    tc = sc.create_lora_training_client(base_model=path, rank=2).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE  # served under its name; the path is an alias
    assert info.model_data.tokenizer_id == path
    out = tc.forward_backward(SFT, "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    sampler = sc.create_sampling_client(base_model=path).result()
    got = sampler.sample(T.ModelInput.from_ints([1, 5]), 1, T.SamplingParams(max_tokens=2))
    assert len(got.result().sequences) == 1
    # the SDK loads a sampler's tokenizer by its base model's name: here, the directory
    tok = sampler.get_tokenizer()
    assert tok.decode(tok.encode("7+5=12", add_special_tokens=False)) == "7+5=12"
    with pytest.raises(tinker.TinkerError, match="not served"):
        sc.create_lora_training_client(base_model="/nowhere/model", rank=2).result()


# ---- 7. the sampling request's limits ------------------------------------------------------


def test_sampling_request_limits_on_both_transports(world: World, sc: tinker.ServiceClient) -> None:
    many = [f"s{i}" for i in range(100_000)]  # about 1 MB of stop strings
    prompt = [1, 5, 9]
    sampler = sc.create_sampling_client(base_model=BASE).result()
    with pytest.raises(
        tinker.BadRequestError, match=r"sampling_params.stop: 100000 stop strings; at most 32"
    ):
        sampler.sample(
            T.ModelInput.from_ints(prompt), 1, T.SamplingParams(max_tokens=2, stop=many)
        ).result()
    with pytest.raises(
        tinker.BadRequestError,
        match=r"sampling_params.stop: stop string 0 has 300 characters; 1..256 are allowed",
    ):
        sampler.sample(
            T.ModelInput.from_ints(prompt), 1, T.SamplingParams(max_tokens=2, stop=["x" * 300])
        ).result()
    ok = sampler.sample(
        T.ModelInput.from_ints(prompt), 1, T.SamplingParams(max_tokens=2, stop=["x"] * 32)
    ).result()
    assert len(ok.sequences) == 1
    with _grpc(world) as client:
        grpc_sampler = client.create_sampling_client(BASE)
        with pytest.raises(
            InvalidArgumentError, match=r"params.stop: 100000 stop strings; at most 32"
        ):
            grpc_sampler.sample(prompt, 1, treadle.SamplingParams(max_tokens=2, stop=many)).result(
                60
            )
        with pytest.raises(
            InvalidArgumentError, match=r"params.stop: 300 stop token ids; at most 256"
        ):
            grpc_sampler.sample(
                prompt, 1, treadle.SamplingParams(max_tokens=2, stop=list(range(300)))
            ).result(60)
