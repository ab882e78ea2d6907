"""The wire contract: committed stubs match protos/, every RPC has a handler, and the
names on the wire (stop reasons, op kinds) have exactly one definition each side.

(The LossFn enum against the loss registry is tests/unit/trainer/test_losses.py.)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

import treadle.server
import treadle.v1
from tests.helpers import raw_channel, script_check
from treadle import _convert as sdk_convert
from treadle import types as sdk_types
from treadle.common.engine import domain
from treadle.server.rpc import convert as server_convert
from treadle.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]


def _pb2_modules() -> list[ModuleType]:
    names = [m.name for m in pkgutil.iter_modules(treadle.v1.__path__) if m.name.endswith("_pb2")]
    return [importlib.import_module(f"treadle.v1.{n}") for n in sorted(names)]


def _services() -> list[tuple[ModuleType, ServiceDescriptor]]:
    return [(m, s) for m in _pb2_modules() for s in m.DESCRIPTOR.services_by_name.values()]


def _server_modules() -> list[ModuleType]:
    out = []
    for info in pkgutil.walk_packages(treadle.server.__path__, "treadle.server."):
        try:
            out.append(importlib.import_module(info.name))
        except ImportError:  # an optional backend whose extra is not installed
            continue
    return out


def test_committed_stubs_match_the_protos() -> None:
    proc = script_check("gen_protos.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_proto_has_stubs() -> None:
    protos = {p.stem for p in (ROOT / "protos" / "treadle" / "v1").glob("*.proto")}
    assert protos >= {"common", "training", "sampling", "server"}
    assert {m.__name__.rsplit(".", 1)[1].removesuffix("_pb2") for m in _pb2_modules()} == protos


def test_the_three_core_services_are_there() -> None:
    names = {s.full_name for _, s in _services()}
    assert {
        "treadle.v1.TrainingService",
        "treadle.v1.SamplingService",
        "treadle.v1.ServerService",
    } <= names


def _servicer_for(service: ServiceDescriptor) -> tuple[type, type]:
    """(the server's servicer class, the generated base class) of a service."""
    grpc_mod = importlib.import_module(
        service.file.name.removesuffix(".proto").replace("/", ".") + "_pb2_grpc"
    )
    base = getattr(grpc_mod, f"{service.name}Servicer")
    _server_modules()
    impls = [c for c in base.__subclasses__() if c.__module__.startswith("treadle.server")]
    assert len(impls) == 1, f"{service.full_name}: servicers {impls}"
    return impls[0], base


@pytest.mark.parametrize("service", [s for _, s in _services()], ids=lambda s: s.name)
def test_every_rpc_has_an_async_handler(service: ServiceDescriptor) -> None:
    impl, base = _servicer_for(service)
    for method in service.methods:
        handler = getattr(impl, method.name, None)
        assert handler is not None, f"{service.name}.{method.name}: no handler"
        assert handler is not getattr(base, method.name), (
            f"{service.name}.{method.name}: only the generated UNIMPLEMENTED stub"
        )
        if method.server_streaming:
            assert inspect.isasyncgenfunction(handler), f"{method.name}: not an async generator"
        else:
            assert inspect.iscoroutinefunction(handler), f"{method.name}: not async"


def _call(
    channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor
) -> grpc.StatusCode:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{service.full_name}/{method.name}"
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    stub = kinds[(method.client_streaming, method.server_streaming)](
        path,
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    request = request_cls()
    arg = iter([request]) if method.client_streaming else request
    try:
        result = stub(arg, timeout=20)
        if method.server_streaming:
            for _ in result:
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_every_rpc_is_served(server: typing.Any) -> None:
    """Each method answers an empty request with something other than UNIMPLEMENTED
    (usually INVALID_ARGUMENT or NOT_FOUND): its servicer is registered."""
    with raw_channel(server) as channel:
        codes = {
            f"{s.name}.{m.name}": _call(channel, s, m) for _, s in _services() for m in s.methods
        }
    unimplemented = [name for name, code in codes.items() if code == grpc.StatusCode.UNIMPLEMENTED]
    assert unimplemented == []
    assert codes["TrainingService.ForwardBackward"] == grpc.StatusCode.NOT_FOUND
    assert codes["ServerService.GetServerInfo"] == grpc.StatusCode.OK


# ---- one definition per name -----------------------------------------------------------------


def _enum_names(enum: typing.Any, unspecified: str) -> set[str]:
    return {v.name.lower() for v in enum.DESCRIPTOR.values if v.name != unspecified}


def test_stop_reasons_cover_each_other() -> None:
    """The engine's names are the wire's; the SDK reads every wire value as tinker's
    coarse ``stop_reason`` plus ``stopped_by`` (which of EOS, stop string, stop token)."""
    wire = _enum_names(common_pb2.StopReason, "STOP_REASON_UNSPECIFIED")
    assert {"stop", "stop_string", "stop_token"} <= wire  # an EOS, a string, a token differ
    assert set(server_convert._STOP_REASONS) == wire
    sdk_values = set(common_pb2.StopReason.values()) - {common_pb2.STOP_REASON_UNSPECIFIED}
    assert set(sdk_convert._STOP_REASONS) == sdk_values
    reasons = {reason for reason, _ in sdk_convert._STOP_REASONS.values()}
    assert reasons == set(typing.get_args(sdk_types.StopReason))
    stopped_by = {by for _, by in sdk_convert._STOP_REASONS.values()} - {None}
    assert stopped_by == set(typing.get_args(sdk_types.StoppedBy))
    for name, value in server_convert._STOP_REASONS.items():
        assert common_pb2.StopReason.Name(value).lower() == name
        reason, by = sdk_convert._STOP_REASONS[value]
        assert reason == ("stop" if name.startswith("stop") else name)
        assert (by is not None) == name.startswith("stop")


def test_op_kinds_cover_each_other() -> None:
    wire = _enum_names(common_pb2.OpKind, "OP_KIND_UNSPECIFIED")
    ops = [
        domain.ForwardBackwardOp,
        domain.ForwardLogprobsOp,
        domain.OptimStepOp,
        domain.SyncWeightsOp,
        domain.SaveStateOp,
        domain.LoadStateOp,
    ]
    kinds = {op.__dataclass_fields__["kind"].default for op in ops}
    assert kinds == wire
    assert wire >= domain.BARRIER_KINDS
    assert {"optim_step", "sync_weights", "save_state", "load_state"} == domain.BARRIER_KINDS
    ordered = set(typing.get_args(domain.OrderedOp)) - {domain.RejectedOp}
    assert ordered == set(ops)
