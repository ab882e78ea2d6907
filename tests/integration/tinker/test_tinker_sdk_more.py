"""More of the official ``tinker`` SDK (0.38.0), unmodified, against ``treadle serve``:
GSPO, weights-only loads, copy_weights, checkpoint management, sessions and the
methods the first file leaves out. One embedded server for the module (tiny model).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402

from tests.integration.tinker.test_tinker_sdk import BASE, SFT, World  # noqa: E402
from tests.integration.tinker.test_tinker_sdk import sc as _sc_fixture  # noqa: E402,F401 (the fixtures)
from tests.integration.tinker.test_tinker_sdk import world as _world_fixture  # noqa: E402,F401


@pytest.fixture(scope="module")
def world(_world_fixture: World) -> World:  # noqa: F811
    """The first file's server, started once for this module."""
    return _world_fixture


@pytest.fixture(scope="module")
def sc(_sc_fixture: tinker.ServiceClient) -> tinker.ServiceClient:  # noqa: F811
    return _sc_fixture


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


#: another tenant's checkpoint: 404 on the request, or NOT_FOUND in the future
MISSING = (tinker.NotFoundError, tinker.RequestFailedError)


def _forward_loss(tc: tinker.TrainingClient) -> float:
    return float(tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"])


def test_checkpoint_ttl_publish_copy_and_listing(world: World, sc: tinker.ServiceClient) -> None:
    """TTL (deleted by the lifecycle sweep once due), publish (readable, never
    writable, by another tenant), the tenant-wide listing and storage usage,
    copy_weights, get_training_run_by_tinker_path, the async delete."""
    rest = sc.create_rest_client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=31).result()
    _steps(tc, 1)
    keep = tc.save_state("keep").result().path
    short = tc.save_state("short").result().path
    at_keep = _forward_loss(tc)

    rest.set_checkpoint_ttl_from_tinker_path(short, 3600).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[short].expires_at is not None and listed[keep].expires_at is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(keep, 10).result()
    assert world.server.ctx is not None
    world.server.ctx.lifecycle.expire_checkpoints(time.time() + 2 * 3600)
    paths = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert short not in paths and keep in paths

    mine = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert keep in mine
    usage = sc.create_rest_client().get_current_checkpoint_storage_usage().result()
    assert usage.data[0].checkpoint_count == len(mine)
    assert usage.data[0].size_bytes > 0

    run = rest.get_training_run_by_tinker_path(keep).result()
    assert run.training_run_id == tc.model_id and run.base_model == BASE

    other = world.client(world.key_b)
    try:
        with pytest.raises(MISSING, match="not found"):
            other.create_training_client_from_state_with_optimizer(keep).result()
        rest.publish_checkpoint_from_tinker_path(keep).result()
        assert keep in [
            c.tinker_path
            for c in rest.list_checkpoints(tc.model_id).result().checkpoints
            if c.public
        ]
        theirs = other.create_training_client_from_state_with_optimizer(keep).result()
        assert _forward_loss(theirs) == pytest.approx(at_keep, rel=1e-6)
        with pytest.raises(MISSING, match="not found"):  # readable, never writable
            other.create_rest_client().delete_checkpoint_from_tinker_path(keep).result()
        rest.unpublish_checkpoint_from_tinker_path(keep).result()
        with pytest.raises(MISSING, match="not found"):
            other.create_training_client_from_state(keep).result()
    finally:
        other.close("success").result()

    copied = rest.copy_weights(keep, "any-project").result()
    assert copied != keep and copied.endswith("/weights/keep")
    copy_run = rest.get_training_run_by_tinker_path(copied).result()
    assert copy_run.training_run_id != tc.model_id
    from_copy = sc.create_training_client_from_state_with_optimizer(copied).result()
    assert _forward_loss(from_copy) == pytest.approx(at_keep, rel=1e-6)
    in_project = tinker.ServiceClient(base_url=world.url, api_key=world.key_a, project_id="p")
    try:  # treadle has no projects: the copy is the caller's, whatever project is named
        assert in_project.copy_weights(keep).result().endswith("/weights/keep")
    finally:
        in_project.close("success").result()

    async def run_async() -> None:
        await rest.delete_checkpoint_from_tinker_path_async(copied)
        assert await rest.get_training_run_by_tinker_path_async(keep)
        await rest.copy_weights_async(keep, "any-project")
        await rest.set_checkpoint_ttl_from_tinker_path_async(keep, None)
        await rest.publish_checkpoint_from_tinker_path_async(keep)
        await rest.unpublish_checkpoint_from_tinker_path_async(keep)
        assert (await rest.list_user_checkpoints_async()).checkpoints
        assert (await rest.get_current_checkpoint_storage_usage_async()).data

    asyncio.run(run_async())
    assert copied not in [
        c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
    ]


def test_sessions_samplers_and_names_survive_a_new_table(
    world: World, sc: tinker.ServiceClient
) -> None:
    """get_session / list_sessions / get_sampler; the names the API gave out are in
    the database, so a fresh name table (as after a restart) resolves them."""
    from treadle.server.http.names import Names

    rest = sc.create_rest_client()
    session_id = sc.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=41).result()
    sampler = sc.create_sampling_client(base_model=BASE).result()
    sampler_id = sampler._sampling_session_id
    got = rest.get_session(session_id).result()
    assert tc.model_id in got.training_run_ids and sampler_id in got.sampler_ids
    assert rest.get_sampler(sampler_id).result().base_model == BASE

    path = tc.save_weights_for_sampler("named").result().path
    assert world.server.ctx is not None
    fresh = Names(world.server.ctx.session)
    tenant_id = world.server.ctx.owners[tc.model_id]
    assert fresh.sampler_weights_uri(tenant_id, path).startswith(f"treadle://{tc.model_id}/v/")
    with pytest.raises(Exception, match="not found"):
        fresh.sampler_weights_uri("someone-else", path)

    async def run_async() -> None:
        assert session_id in (await rest.list_sessions_async(limit=1000)).sessions
        assert tc.model_id in (await rest.get_session_async(session_id)).training_run_ids
        assert (await rest.get_sampler_async(sampler_id)).base_model == BASE

    asyncio.run(run_async())


def test_the_methods_not_exercised_elsewhere(sc: tinker.ServiceClient) -> None:
    """get_server_capabilities(_async) on the ServiceClient, SamplingClient.create,
    forward_backward_custom_async."""
    import torch

    caps = sc.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    sampler = tinker.SamplingClient.create(sc.holder, base_model=BASE).result()
    out = sampler.sample(T.ModelInput.from_ints([1, 2]), 1, T.SamplingParams(max_tokens=2))
    assert len(out.result().sequences) == 1
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=51).result()

    def loss(data: list[T.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        total = -sum(lp.sum() for lp in logprobs)
        return total, {"nll": float(total)}

    async def run() -> None:
        caps_async = await sc.get_server_capabilities_async()
        assert caps_async.supported_models
        res = await (await tc.forward_backward_custom_async(SFT, loss)).result_async()
        assert res.metrics["nll"] == pytest.approx(_forward_loss(tc), rel=1e-5)

    asyncio.run(run())


def test_search_sessions_filters_pages_and_keeps_to_the_tenant(world: World) -> None:
    """RestClient.search_sessions: by user_metadata, display name words, id, status
    (a client's own finish reason), one page at a time; checkpoints counted per
    session; another tenant's sessions never match; projects and per-user owners
    are 400s that say why."""
    import warnings

    from tinker.types import SessionSearchRequest as Q

    warnings.simplefilter("ignore")  # search_sessions is marked experimental in the SDK
    tag = {"exp": f"search-{time.time_ns()}"}

    def client(key: str, run: str, name: str) -> tinker.ServiceClient:
        sc = tinker.ServiceClient(
            base_url=world.url, api_key=key, user_metadata={**tag, "run": run}, display_name=name
        )
        sc.holder.get_session_id()  # the session is made here
        return sc

    a = client(world.key_a, "a", "Nightly Sweep alpha")
    b = client(world.key_a, "b", "nightly sweep beta")
    other = client(world.key_b, "c", "Nightly Sweep alpha")
    ids = {n: c.holder.get_session_id() for n, c in (("a", a), ("b", b), ("other", other))}
    rest = b.create_rest_client()  # b's: a closes before the end

    def found(**kw: object) -> list[str]:
        return [s.session_id for s in rest.search_sessions(Q(**kw)).result().sessions]

    tc = b.create_lora_training_client(base_model=BASE, rank=2, seed=61).result()
    tc.save_state("kept").result()
    assert found(user_metadata=tag) == [ids["b"], ids["a"]]  # newest first; not "other"
    assert found(user_metadata={**tag, "run": "a"}) == [ids["a"]]
    assert found(user_metadata=tag, display_name="sweep ALPHA") == [ids["a"]]
    assert found(user_metadata=tag, display_name="alpha", session_id=ids["b"]) == [
        ids["b"],
        ids["a"],
    ]
    assert found(session_id=ids["other"]) == []  # another tenant's: as if missing

    first = rest.search_sessions(Q(user_metadata=tag, limit=1)).result()
    assert [s.session_id for s in first.sessions] == [ids["b"]] and first.next_cursor
    second = rest.search_sessions(Q(user_metadata=tag, limit=1, cursor=first.next_cursor))
    page = second.result()
    assert [s.session_id for s in page.sessions] == [ids["a"]] and page.next_cursor is None
    got = first.sessions[0]
    assert got.display_name == "nightly sweep beta" and got.user_metadata == {**tag, "run": "b"}
    assert got.checkpoints_count == 1 and (got.checkpoint_storage_bytes or 0) > 0
    assert got.status is not None and got.status.type == "active"

    a.close("interrupted").result()
    finished = [{"type": "client_finished", "reasons": ["interrupted"]}]
    assert found(user_metadata=tag, statuses=finished) == [ids["a"]]
    assert found(user_metadata=tag, statuses=[{"type": "active"}]) == [ids["b"]]
    assert found(user_metadata=tag, statuses=[{"type": "failed"}]) == []
    summary = rest.search_sessions(Q(session_id=ids["a"])).result().sessions[0]
    assert summary.status is not None and summary.status.type == "client_finished"
    assert summary.status.reason.type == "interrupted"

    for bad, field in (
        ({"project_ids": ["p"]}, "project_ids"),
        ({"limit": 0}, "limit"),
        ({"statuses": [{"type": "client_finished", "reasons": "success"}]}, "reasons"),
        ({"cursor": {"last_created_at": "yesterday", "last_session_id": "s"}}, "last_created_at"),
    ):
        answer = world.post("sessions/search", world.key_a, json=bad)
        assert answer.status_code == 400 and field in answer.text, answer.text
    answer = world.post(
        "sessions/search", world.key_a, json={"owner": {"type": "user", "owner_urns": ["u"]}}
    )
    assert answer.status_code == 400 and "owner.type" in answer.text
    for sc in (b, other):
        sc.close("success").result()


def test_export_session_trace_is_a_keyless_link_to_the_sessions_calls(
    world: World, sc: tinker.ServiceClient
) -> None:
    """RestClient.export_session_trace(_async): a URL fetched without a key, whose
    trace-event JSON has a track per training run of the session and a slice per
    ordered call in seq_id order; another tenant's session is 404 as a missing
    one, and a made-up token is 404."""
    rest = sc.create_rest_client()
    session_id = sc.holder.get_session_id()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=71).result()
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    time.sleep(0.5)  # a call's end is written just behind its answer

    url = rest.export_session_trace(session_id).result()
    answer = httpx.get(url, timeout=60)  # no key
    assert answer.status_code == 200, answer.text
    events = answer.json()["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M"}
    assert tracks[f"session {session_id}"] == 0
    pid = tracks[f"training run {tc.model_id}"]
    calls = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
    kinds = [e["name"] for e in calls]
    assert "forward_backward" in kinds and "optim_step" in kinds, kinds
    seqs = [e["args"]["seq_id"] for e in calls]
    assert seqs == sorted(seqs) and all(e["dur"] >= 0 and e["ts"] >= 0 for e in calls)
    assert all(e["args"]["status"] == "done" for e in calls), calls
    made = [e for e in events if e["name"] == f"sampler {sampler._sampling_session_id}"]
    assert [e["pid"] for e in made] == [pid]
    # the run's metrics are counter tracks: what the calls returned, at their ends
    world.server.flush_records()  # written every 2 s; now, for the test
    events = httpx.get(url, timeout=60).json()["traceEvents"]
    loss = [e for e in events if e["ph"] == "C" and e["name"] == "loss:sum" and e["pid"] == pid]
    assert len(loss) == 1 and loss[0]["args"]["loss:sum"] > 0, loss
    end_fb = next(e["ts"] + e["dur"] for e in calls if e["name"] == "forward_backward")
    assert loss[0]["ts"] == end_fb

    async def run_async() -> str:
        return await rest.export_session_trace_async(session_id)

    assert httpx.get(asyncio.run(run_async()), timeout=60).status_code == 200
    other = tinker.ServiceClient(base_url=world.url, api_key=world.key_b)
    try:
        with pytest.raises(tinker.NotFoundError):
            other.create_rest_client().export_session_trace(session_id).result()
    finally:
        other.close("success").result()
    assert httpx.get(url.rsplit("/", 1)[0] + "/made-up", timeout=60).status_code == 404
