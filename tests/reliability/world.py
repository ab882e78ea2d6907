"""The server the fuzzer attacks, what it holds, and the checks made after each case.

Tenant A (the caller) owns a *target* model with a saved checkpoint, a sampler and
a session; tenant B owns the same set. After every case: the server answers a
health check, A's target model has the weights it had (a hash of a fixed probe's
logprobs) unless the call was accepted, its next seq_id moved only as the seq_id
contract allows, and B's model did not move at all.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

import treadle
from tests.helpers import tenant_key as tenant_key
from tests.integration.rpc_walk import call_raw
from tests.reliability.messages import Pools
from treadle._convert import datums_to_wire
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import (
    sampling_pb2,
    sampling_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)

BASE = "tiny"
VOCAB = 104
MAX_BYTES = 4 * 1024 * 1024  # the smallest limit the server takes
OK = grpc.StatusCode.OK
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.ALREADY_EXISTS,  # a checkpoint name taken (a refusal like the others)
}
PROBE = datums_to_wire(
    [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
    ]
)


def server_config(data_dir: Path, model_dir: Path) -> ServerConfig:
    return ServerConfig(
        data_dir=data_dir,
        models={BASE: model_dir},
        port=0,
        threads=1,
        gap_timeout_s=0.3,  # a skipped seq_id is answered ABORTED in 0.3 s, not 60
        sampler_max_len=64,
        sampler_slots=8,
        max_message_bytes=MAX_BYTES,
        quota_max_models=12,
        # thousands of cases with huge num_samples x max_tokens use up a minute's
        # tokens and would starve the weights probe; the quota has its own tests
        quota_tokens_per_minute=0,
    )


def field_names(desc: Descriptor, seen: set[str] | None = None) -> set[str]:
    """Every field name reachable from ``desc``: what an INVALID_ARGUMENT may name."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    if desc.full_name in seen:
        return names
    seen.add(desc.full_name)
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= field_names(f.message_type, seen)
    return names


@dataclass
class Holdings:
    model_id: str
    sampler_id: str
    session_id: str
    path: str
    next_seq: int


@dataclass
class World:
    server: EmbeddedServer
    key_a: str
    key_b: str
    a: Holdings
    b: Holdings
    weights_hash: str = ""
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.server.address)
        self.weights_hash = self.probe()

    def meta(self, key: str | None) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {key}"),) if key else ()

    def pools(self) -> Pools:
        b = self.b
        return Pools(
            model_ids=[self.a.model_id],
            other_tenant_ids=[b.model_id, b.sampler_id, b.session_id, b.path],
            sampler_ids=[self.a.sampler_id],
            session_ids=[self.a.session_id],
            paths=[self.a.path, f"treadle://{self.a.model_id}/latest"],
            base_models=[BASE],
            next_seq=self.a.next_seq,
            vocab=VOCAB,
        )

    # ---- what the checks read --------------------------------------------------------

    def healthy(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def info(self, model_id: str, key: str) -> Any:
        stub = training_pb2_grpc.TrainingServiceStub(self.channel)
        return stub.GetModelInfo(
            training_pb2.GetModelInfoRequest(model_id=model_id), metadata=self.meta(key), timeout=30
        )

    def probe(self) -> str:
        """A hash of the target's logprobs on a fixed datum (takes the next seq_id)."""
        self.a.next_seq = self.info(self.a.model_id, self.key_a).next_seq_id
        stub = training_pb2_grpc.TrainingServiceStub(self.channel)
        req = training_pb2.ForwardLogprobsRequest(model_id=self.a.model_id, seq_id=self.a.next_seq)
        req.data.extend(PROBE)
        out = stub.ForwardLogprobs(req, metadata=self.meta(self.key_a), timeout=60)
        self.a.next_seq += 1
        return hashlib.sha256(out.outputs[0].outputs["logprobs"].data).hexdigest()

    def call(self, method: Any, payload: bytes, key: str | None) -> tuple[Any, str, list[Any]]:
        return call_raw(self.channel, method, payload, self.meta(key), timeout=60)

    def call_delete(self, model_id: str) -> None:
        """Free a model a fuzzed call created (so the quota does not end the run)."""
        stub = training_pb2_grpc.TrainingServiceStub(self.channel)
        for key in (self.key_a, self.key_b):
            with contextlib.suppress(grpc.RpcError):
                stub.DeleteModel(
                    training_pb2.DeleteModelRequest(model_id=model_id), metadata=self.meta(key)
                )

    def replace_target(self) -> None:
        self.a = seed(self.server, self.key_a)
        self.weights_hash = self.probe()

    def close(self) -> None:
        self.channel.close()


def seed(srv: EmbeddedServer, key: str) -> Holdings:
    """A model with a saved checkpoint, a sampler and a session, made with ``key``."""
    meta = (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(srv.address) as ch:
        training = training_pb2_grpc.TrainingServiceStub(ch)
        session = session_pb2_grpc.SessionServiceStub(ch).CreateSession(
            session_pb2.CreateSessionRequest(), metadata=meta, timeout=30
        )
        info = training.CreateModel(
            training_pb2.CreateModelRequest(base_model=BASE, lora_rank=2, seed=1),
            metadata=meta,
            timeout=60,
        )
        saved = training.SaveState(
            training_pb2.SaveStateRequest(model_id=info.model_id, seq_id=1, name="seed"),
            metadata=meta,
            timeout=60,
        )
        sampler = sampling_pb2_grpc.SamplingServiceStub(ch).CreateSampler(
            sampling_pb2.CreateSamplerRequest(weights=f"treadle://{info.model_id}/latest"),
            metadata=meta,
            timeout=60,
        )
    return Holdings(info.model_id, sampler.sampler_id, session.session_id, saved.path, 2)
