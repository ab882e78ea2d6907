"""Tenants are walls (DESIGN.md invariant 2), checked on every RPC the server has.

Tenant A makes one of everything (a model with a published version and a saved
checkpoint, a sampler, a session). Tenant B then calls every RPC of every
service found in the generated descriptors with A's ids: each answers NOT_FOUND
with exactly the message an id that never existed gets (no existence leak), or,
for an RPC that takes no id, shows B only B's own things. An RPC this file has
no case for fails the test: adding an RPC means deciding here how it keeps the
wall. Afterwards A finds everything as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

import treadle
from tests.helpers import tenant_key
from tests.integration.rpc_walk import all_methods, call_raw
from treadle._convert import adam_to_wire, datums_to_wire, prompt_to_wire
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import common_pb2, sampling_pb2, server_pb2, training_pb2

BASE = "tiny"
FAKE = {  # ids of the same shapes that never existed
    "model": "m-00000000deadbeef",
    "sampler": "s-00000000deadbeef",
    "session": "sess-00000000deadbeef",
}


@dataclass
class World:
    server: EmbeddedServer
    key_a: str
    key_b: str
    ids: dict[str, str]  # A's ids: model, sampler, session
    model_b: str  # B's own model (for calls that take B's model and A's path)
    next_seq_a: int
    seq_b: int = 0

    def next_seq_b(self) -> int:
        """A fresh seq_id on B's model (a refused call still takes its seq_id)."""
        self.seq_b += 1
        return self.seq_b


def _datum() -> treadle.Datum:
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )


def _raw(world: World, key: str, method_name: str, request: Message) -> tuple[Any, str, list[Any]]:
    method = next(m for m in all_methods() if m.full_name == method_name)
    with grpc.insecure_channel(world.server.address) as channel:
        return call_raw(channel, method, request, (("authorization", f"Bearer {key}"),))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp("walls") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        threads=1,
    )
    srv = EmbeddedServer(config).start()
    key_a, key_b = tenant_key(srv, "alice"), tenant_key(srv, "bob")
    with treadle.ServiceClient(srv.address, api_key=key_a) as a:
        trainer = a.create_lora_training_client(BASE, rank=2)
        trainer.forward_backward([_datum()], "cross_entropy").result()
        trainer.optim_step(treadle.AdamParams(learning_rate=1e-3)).result()
        trainer.sync_weights()  # publishes version 1
        trainer.save_state("ck").result()
        sampler = a.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
        info = a.get_model_info(trainer.model_id)
        ids = {"model": trainer.model_id, "sampler": sampler.sampler_id}
    world = World(srv, key_a, key_b, ids, "", info.next_seq_id)
    if any(m.full_name == "treadle.v1.SessionService.CreateSession" for m in all_methods()):
        from treadle.v1 import session_pb2

        code, _, out = _raw(
            world,
            key_a,
            "treadle.v1.SessionService.CreateSession",
            session_pb2.CreateSessionRequest(),
        )
        assert code == grpc.StatusCode.OK
        ids["session"] = out[0].session_id
    with treadle.ServiceClient(srv.address, api_key=key_b) as b:
        world.model_b = b.create_lora_training_client(BASE, rank=2).model_id
    yield world
    srv.stop()


# ---- the cases: one per RPC -------------------------------------------------------------

Ids = dict[str, str]
#: an RPC that takes ids: the request B sends, built from A's ids (or the fake ones)
IdCase = Callable[[Ids, World], Message]
#: an RPC without ids: a check that B sees only its own things
OwnCase = Callable[[World], None]


def _fb(ids: Ids, w: World, seq: int) -> Message:
    req = training_pb2.ForwardBackwardRequest(
        model_id=ids["model"], seq_id=seq, loss_fn=common_pb2.LossFn.Value("CROSS_ENTROPY")
    )
    req.data.extend(datums_to_wire([_datum()]))
    return req


def _fl(ids: Ids, w: World, seq: int) -> Message:
    req = training_pb2.ForwardLogprobsRequest(model_id=ids["model"], seq_id=seq)
    req.data.extend(datums_to_wire([_datum()]))
    return req


def _sample(ids: Ids, w: World) -> Message:
    req = sampling_pb2.SampleRequest(sampler_id=ids["sampler"], num_samples=1)
    prompt_to_wire(treadle.ModelInput.from_ints([1, 2]), req.prompt)
    req.params.max_tokens = 2
    return req


def _path(ids: Ids) -> str:
    return f"treadle://{ids['model']}/state/ck"


# Ordered calls are tried at a seq_id A already applied (B must not get A's
# recorded result) and at A's next one (B's call must not be applied).
ID_CASES: dict[str, list[IdCase]] = {
    "treadle.v1.TrainingService.CreateModel": [
        lambda ids, w: training_pb2.CreateModelRequest(from_state=_path(ids)),
    ],
    "treadle.v1.TrainingService.GetModelInfo": [
        lambda ids, w: training_pb2.GetModelInfoRequest(model_id=ids["model"]),
    ],
    "treadle.v1.TrainingService.DeleteModel": [
        lambda ids, w: training_pb2.DeleteModelRequest(model_id=ids["model"]),
    ],
    "treadle.v1.TrainingService.ForwardBackward": [
        lambda ids, w: _fb(ids, w, 1),
        lambda ids, w: _fb(ids, w, w.next_seq_a),
    ],
    "treadle.v1.TrainingService.ForwardLogprobs": [
        lambda ids, w: _fl(ids, w, 1),
        lambda ids, w: _fl(ids, w, w.next_seq_a),
    ],
    "treadle.v1.TrainingService.OptimStep": [
        lambda ids, w: training_pb2.OptimStepRequest(
            model_id=ids["model"],
            seq_id=w.next_seq_a,
            adam_params=adam_to_wire(treadle.AdamParams(learning_rate=1.0)),
        ),
    ],
    "treadle.v1.TrainingService.SyncWeights": [
        lambda ids, w: training_pb2.SyncWeightsRequest(
            model_id=ids["model"], seq_id=w.next_seq_a, create_sampler=True
        ),
    ],
    "treadle.v1.TrainingService.SaveState": [
        lambda ids, w: training_pb2.SaveStateRequest(
            model_id=ids["model"], seq_id=w.next_seq_a, name="ck"
        ),
    ],
    "treadle.v1.TrainingService.LoadState": [
        # A's model with its own path, and B's model with A's path
        lambda ids, w: training_pb2.LoadStateRequest(
            model_id=ids["model"], seq_id=w.next_seq_a, path=_path(ids)
        ),
        lambda ids, w: training_pb2.LoadStateRequest(
            model_id=w.model_b, seq_id=w.next_seq_b(), path=_path(ids)
        ),
    ],
    "treadle.v1.TrainingService.ListCheckpoints": [
        lambda ids, w: training_pb2.ListCheckpointsRequest(model_id=ids["model"]),
    ],
    "treadle.v1.TrainingService.DeleteCheckpoint": [
        lambda ids, w: _msg("DeleteCheckpointRequest", path=_path(ids)),
    ],
    "treadle.v1.TrainingService.RestoreModel": [
        lambda ids, w: _msg("RestoreModelRequest", model_id=ids["model"]),
    ],
    "treadle.v1.TrainingService.ExportWeights": [
        lambda ids, w: _msg("ExportWeightsRequest", model_id=ids["model"]),
        lambda ids, w: _msg("ExportWeightsRequest", model_id=ids["model"], merged=True),
    ],
    "treadle.v1.TrainingService.LogMetrics": [
        lambda ids, w: _msg("LogMetricsRequest", model_id=ids["model"], step=1, metrics={"r": 1.0}),
    ],
    "treadle.v1.TrainingService.GetUsage": [
        lambda ids, w: _msg("GetUsageRequest", model_id=ids["model"]),
    ],
    "treadle.v1.SamplingService.CreateSampler": [
        lambda ids, w: sampling_pb2.CreateSamplerRequest(weights=f"treadle://{ids['model']}/v/1"),
        lambda ids, w: sampling_pb2.CreateSamplerRequest(
            weights=f"treadle://{ids['model']}/latest"
        ),
    ],
    "treadle.v1.SamplingService.Sample": [_sample],
    "treadle.v1.SamplingService.SampleStream": [_sample],
    "treadle.v1.SamplingService.Resume": [
        lambda ids, w: sampling_pb2.ResumeRequest(
            sampler_id=ids["sampler"], resume_handles=["rh-x"], params={"max_tokens": 4}
        ),
    ],
    "treadle.v1.SessionService.Heartbeat": [
        lambda ids, w: _session_msg("HeartbeatRequest", session_id=ids["session"]),
    ],
    "treadle.v1.SessionService.EndSession": [
        lambda ids, w: _session_msg("EndSessionRequest", session_id=ids["session"]),
    ],
}


def _msg(name: str, **fields: Any) -> Message:
    return getattr(training_pb2, name)(**fields)


def _session_msg(name: str, **fields: Any) -> Message:
    from treadle.v1 import session_pb2

    return getattr(session_pb2, name)(**fields)


def _own_list_models(w: World) -> None:
    code, _, out = _raw(
        w, w.key_b, "treadle.v1.TrainingService.ListModels", training_pb2.ListModelsRequest()
    )
    assert code == grpc.StatusCode.OK
    assert [m.model_id for m in out[0].models] == [w.model_b]


def _own_server_info(w: World) -> None:
    code, _, out = _raw(
        w, w.key_b, "treadle.v1.ServerService.GetServerInfo", server_pb2.GetServerInfoRequest()
    )
    assert code == grpc.StatusCode.OK  # base models are shared by every tenant; nothing else
    assert w.ids["model"] not in str(out[0])


def _own_tokenizer(w: World) -> None:
    code, _, out = _raw(
        w,
        w.key_b,
        "treadle.v1.ServerService.GetTokenizer",
        server_pb2.GetTokenizerRequest(base_model=BASE),
    )
    assert code == grpc.StatusCode.OK and out  # a shared base model's files


def _own_create_session(w: World) -> None:
    from treadle.v1 import session_pb2

    code, _, out = _raw(
        w, w.key_b, "treadle.v1.SessionService.CreateSession", session_pb2.CreateSessionRequest()
    )
    assert code == grpc.StatusCode.OK and out[0].session_id != w.ids["session"]


OWN_CASES: dict[str, OwnCase] = {
    "treadle.v1.TrainingService.ListModels": _own_list_models,
    "treadle.v1.ServerService.GetServerInfo": _own_server_info,
    "treadle.v1.ServerService.GetTokenizer": _own_tokenizer,
    "treadle.v1.SessionService.CreateSession": _own_create_session,
}


def test_every_rpc_has_a_case() -> None:
    names = {m.full_name for m in all_methods()}
    missing = names - ID_CASES.keys() - OWN_CASES.keys()
    assert not missing, f"RPCs with no tenant-wall case in {__file__}: {sorted(missing)}"


def test_other_tenants_ids_are_not_found_like_ids_that_never_existed(world: World) -> None:
    names = {m.full_name for m in all_methods()}
    fake = dict(FAKE)
    checked = 0
    for name in sorted(names & ID_CASES.keys()):
        for i, case in enumerate(ID_CASES[name]):
            code, details, _ = _raw(world, world.key_b, name, case(world.ids, world))
            fake_code, fake_details, _ = _raw(world, world.key_b, name, case(fake, world))
            where = f"{name} case {i}"
            assert code == grpc.StatusCode.NOT_FOUND, (where, code, details)
            assert fake_code == grpc.StatusCode.NOT_FOUND, (where, fake_code, fake_details)
            shown = details
            for kind, real in world.ids.items():
                shown = shown.replace(real, fake[kind])
            assert shown == fake_details, (where, details, fake_details)
            checked += 1
    assert checked >= 15


def test_rpcs_without_ids_show_only_the_callers_things(world: World) -> None:
    names = {m.full_name for m in all_methods()}
    for name in sorted(names & OWN_CASES.keys()):
        OWN_CASES[name](world)


def test_a_finds_everything_as_it_was(world: World) -> None:
    """Runs after the walls were tested: nothing B sent changed A's things."""
    with treadle.ServiceClient(world.server.address, api_key=world.key_a) as a:
        info = a.get_model_info(world.ids["model"])
        assert info.next_seq_id == world.next_seq_a  # no call of B's was applied
        assert info.status == "active"
        trainer = a.get_training_client(world.ids["model"])
        assert [c.name for c in trainer.list_checkpoints()] == ["ck"]
        sampler = a.create_sampling_client(weights=f"treadle://{world.ids['model']}/latest")
        out = sampler.sample(
            treadle.ModelInput.from_ints([1, 2]), 1, treadle.SamplingParams(max_tokens=2)
        )
        assert len(out.result().sequences) == 1
    if "session" in world.ids:
        from treadle.v1 import session_pb2

        code, details, _ = _raw(
            world,
            world.key_a,
            "treadle.v1.SessionService.Heartbeat",
            session_pb2.HeartbeatRequest(session_id=world.ids["session"]),
        )
        assert code == grpc.StatusCode.OK, details
