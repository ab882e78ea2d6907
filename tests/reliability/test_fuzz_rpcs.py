"""Every RPC of every service, fuzzed from the descriptors (issue 24, item 1).

For each method found in the generated ``treadle.v1`` descriptors (so an RPC added
later is fuzzed without editing this file), hypothesis builds requests from the
request's message descriptor (``messages.py``): fields missing or set, odd
strings, edge integers, NaN / inf / subnormal floats, tensors with tokens out of
range and shapes that disagree, empty and oversized repeated fields, unknown enum
values, seq_ids that repeat, skip or go back, other tenants' ids; then some are
broken at the wire level or pushed over the message size limit; and sent with
the caller's key, no key, a bad key or another tenant's key.

Every answer must be in ``EXPECTED`` (never UNKNOWN, INTERNAL, a timeout or a
dropped connection); an INVALID_ARGUMENT names a field; a call without a valid
key gets UNAUTHENTICATED; afterwards the server is healthy, the target model's
weights are as before unless the call was accepted, its next seq_id moved only
by the refused call's own seq_id, and the other tenant's model did not move.

Short profile (CI): ``TREADLE_FUZZ_EXAMPLES`` cases per RPC (default 6), derandomized.
Long profile: ``pytest tests/reliability --long`` (2000 per RPC, or the env value).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.rpc_walk import all_methods, request_class
from tests.reliability import stats
from tests.reliability.messages import build, message_values, mutate
from tests.reliability.world import (
    EXPECTED,
    MAX_BYTES,
    OK,
    World,
    field_names,
    seed,
    server_config,
    tenant_key,
)
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import common_pb2, sampling_pb2, training_pb2, training_pb2_grpc


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    srv = EmbeddedServer(
        server_config(tmp_path_factory.mktemp("fuzz") / "data", tiny_model_dir)
    ).start()
    assert srv.api_key is not None
    key_b = tenant_key(srv, "fuzz-b")
    w = World(srv, srv.api_key, key_b, seed(srv, srv.api_key), seed(srv, key_b))
    yield w
    w.close()
    srv.stop()


@pytest.fixture(scope="module")
def profile(request: pytest.FixtureRequest) -> settings:
    long = bool(request.config.getoption("--long"))
    examples = int(os.environ.get("TREADLE_FUZZ_EXAMPLES", "2000" if long else "6"))
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not long,  # CI: the same cases every run
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


def _leaks_other_tenant(world: World, payload: bytes) -> bool:
    return any(x.encode() in payload for x in world.pools().other_tenant_ids)


def run_case(world: World, method: MethodDescriptor, data: st.DataObject) -> None:
    name = method.full_name
    world.a.next_seq = world.info(world.a.model_id, world.key_a).next_seq_id  # resync
    values = data.draw(message_values(method.input_type, world.pools()), label="fields")
    request = build(method.input_type, values)
    kind, payload = data.draw(
        mutate(method.input_type, request.SerializeToString(), MAX_BYTES), label="wire"
    )
    who = data.draw(st.sampled_from(["a"] * 7 + ["none", "bad", "b"]), label="key")
    key = {"a": world.key_a, "b": world.key_b, "none": None, "bad": "tdl-" + "x" * 43}[who]
    before_a, before_b = world.a.next_seq, world.info(world.b.model_id, world.key_b).next_seq_id
    with stats.timed(name):
        code, details, out = world.call(method, payload, key)
    stats.record(name, code.name)
    case = f"{name} [{kind}, key {who}] -> {code.name}: {details}\nrequest: {request}"

    unauth = code == grpc.StatusCode.UNAUTHENTICATED and who in ("none", "bad")
    assert code in EXPECTED or unauth, case
    if who in ("none", "bad") and kind != "oversize":  # the transport refuses size first
        assert code == grpc.StatusCode.UNAUTHENTICATED, case
    if code == grpc.StatusCode.INVALID_ARGUMENT and kind == "as_is":
        named = field_names(method.input_type) | {"loss_fn_inputs", "request"}
        assert any(n in details for n in named), f"names no field: {case}"
    if code == OK and kind == "as_is" and who == "a":
        assert not _leaks_other_tenant(world, payload), f"accepted another tenant's id: {case}"
    assert world.healthy(), case

    # what the call may have changed
    for reply in out:
        made = getattr(reply, "model_id", "")
        if made and made not in (world.a.model_id, world.b.model_id) and name.endswith("Model"):
            world.call_delete(made)
    assert world.info(world.b.model_id, world.key_b).next_seq_id == before_b, case
    try:
        after = world.info(world.a.model_id, world.key_a).next_seq_id
    except grpc.RpcError as err:  # the fuzzer deleted its own target: accepted, start over
        assert code == OK and err.code() == grpc.StatusCode.NOT_FOUND, case
        world.replace_target()
        return
    try:  # what the server read: a mutated message may still parse (last value wins)
        seen = request_class(method).FromString(payload)
    except DecodeError:
        seen = None
    targeted = seen is not None and getattr(seen, "model_id", None) == world.a.model_id
    consumed = targeted and getattr(seen, "seq_id", None) == before_a
    if code != OK:
        assert after in ((before_a, before_a + 1) if consumed else (before_a,)), case
    old = world.weights_hash
    world.weights_hash = world.probe()
    if code != OK:
        assert world.weights_hash == old, f"a refused call changed the weights: {case}"


@pytest.mark.parametrize("method", all_methods(), ids=lambda m: m.full_name)
def test_rpc_answers_within_contract(
    world: World, profile: settings, method: MethodDescriptor
) -> None:
    @profile
    @given(data=st.data())
    def cases(data: st.DataObject) -> None:
        run_case(world, method, data)

    cases()


def test_every_service_is_walked() -> None:
    """The walk finds the services the server offers (a new proto file is seen too)."""
    services = {m.containing_service.full_name for m in all_methods()}
    assert {
        "treadle.v1.TrainingService",
        "treadle.v1.SamplingService",
        "treadle.v1.ServerService",
        "treadle.v1.SessionService",
    } <= services
    assert training_pb2.DESCRIPTOR.services_by_name["TrainingService"].methods


# ---- what the fuzzer found, kept as explicit cases ------------------------------------


@pytest.mark.parametrize("payload", [b"\n", b"\n\x03\x80\x80\x80", b"\x00"], ids=repr)
def test_undecodable_request_is_invalid_argument(world: World, payload: bytes) -> None:
    """Found by the fuzzer: bytes that are not a valid request (truncated, a varint
    cut short, tag 0) were answered UNKNOWN by gRPC's own deserialization path.
    Now every RPC answers INVALID_ARGUMENT naming the request, after auth."""
    undecodable = []
    for method in all_methods():
        try:
            request_class(method).FromString(payload)
            continue  # valid for this message (e.g. an unknown field of an empty one)
        except DecodeError:
            undecodable.append(method.full_name)
        code, details, _ = world.call(method, payload, world.key_a)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method.full_name, code, details)
        assert details.startswith("request: not a valid"), details
        code, _, _ = world.call(method, payload, None)
        assert code == grpc.StatusCode.UNAUTHENTICATED, method.full_name
    assert len(undecodable) >= 10
    assert world.healthy()


def test_saving_a_name_again_replaces_the_last_checkpoint(world: World) -> None:
    """Found by the fuzzer: SaveState with the name of the model's last checkpoint
    deleted that row while the model still pointed at it (a foreign key): INTERNAL,
    after the engine had written the new state. Now the row is replaced in place."""
    stub = training_pb2_grpc.TrainingServiceStub(world.channel)
    meta = world.meta(world.key_a)
    steps = []
    for _ in range(2):
        seq = world.info(world.a.model_id, world.key_a).next_seq_id
        req = training_pb2.SaveStateRequest(model_id=world.a.model_id, seq_id=seq, name="again")
        steps.append(stub.SaveState(req, metadata=meta, timeout=60).seq_id)
    info = world.info(world.a.model_id, world.key_a)
    assert info.last_checkpoint_seq_id == steps[1]
    listed = stub.ListCheckpoints(
        training_pb2.ListCheckpointsRequest(model_id=world.a.model_id), metadata=meta
    )
    again = [c for c in listed.checkpoints if c.name == "again"]
    assert [c.seq_id for c in again] == [steps[1]]
    world.weights_hash = world.probe()


@pytest.mark.parametrize(
    "dtype, data, shape",
    [
        (common_pb2.BFLOAT16, b"\x01\x02\x03", [1]),  # odd bytes of bfloat16
        (common_pb2.INT32, b"\x05\x00\x00\x00" * 4, [-2, -2]),  # negative dims, product 4
        (common_pb2.INT32, b"\x05\x00\x00\x00" * 4, [2**32, 2**32]),  # product wraps int64
    ],
    ids=["bf16-odd-bytes", "negative-dims", "overflowing-shape"],
)
def test_malformed_tensors_are_invalid_argument(
    world: World, dtype: int, data: bytes, shape: list[int]
) -> None:
    """Found by the fuzzer (Sample answered INTERNAL ``ValueError``): a bfloat16
    tensor of an odd number of bytes; a shape whose dims are negative but whose
    product matches; a shape whose product wraps around in int64."""
    tensor = common_pb2.Tensor(data=data, dtype=dtype, shape=shape)  # type: ignore[arg-type]
    sample = sampling_pb2.SampleRequest(sampler_id=world.a.sampler_id, num_samples=1)
    sample.prompt.CopyFrom(tensor)
    sample.params.max_tokens = 2
    method = {m.name: m for m in all_methods()}
    code, details, _ = world.call(method["Sample"], sample.SerializeToString(), world.key_a)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt"), details
    seq = world.info(world.a.model_id, world.key_a).next_seq_id
    fl = training_pb2.ForwardLogprobsRequest(model_id=world.a.model_id, seq_id=seq)
    fl.data.add().model_input.CopyFrom(tensor)
    code, details, _ = world.call(method["ForwardLogprobs"], fl.SerializeToString(), world.key_a)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("data[0].model_input"), details
    world.weights_hash = world.probe()
