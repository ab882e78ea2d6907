"""Requests generated from the message descriptors, for the fuzzer.

Nothing here knows an RPC by name: a field is filled by its type, and by its name
where the name says what the server will do with it (``*model_id`` gets ids of this
tenant, of another tenant and of nothing; ``seq_id`` gets the next one, a repeat, a
gap, a step back; a ``Tensor`` gets tokens out of the vocabulary or NaN floats; a
``name`` or ``path`` gets traversal attempts). So a field or an RPC added to the
protos later is fuzzed without editing this file. On top of the well-formed
message, some cases are mutated as raw bytes (a field re-sent with another wire
type, truncation, junk, a message over the server's size limit).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

FD = FieldDescriptor
INT_TYPES = {
    FD.TYPE_INT32,
    FD.TYPE_INT64,
    FD.TYPE_SINT32,
    FD.TYPE_SINT64,
    FD.TYPE_SFIXED32,
    FD.TYPE_SFIXED64,
}
UINT_TYPES = {FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64}
FLOAT_TYPES = {FD.TYPE_DOUBLE, FD.TYPE_FLOAT}

#: Unicode that breaks naive string handling: NUL, controls, RTL marks, combining
#: marks, lone surrogates are impossible in proto strings, so astral + BOM + ZWJ
ODD_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\n",
    "\r\n",
    "\x1b[31m",
    "\u202e",
    "\ufeff",
    "\u200d",
    "e\u0301",
    "\U0001f600",
    "\U0010ffff",
    "💥" * 50,
    "x" * 5000,
    "..",
    "../../etc/passwd",
    "/etc/passwd",
    "a/b",
    "%2e%2e",
    "\\..\\",
]
EDGE_INTS = [0, 1, -1, 2, 3, 7, 2**31 - 1, -(2**31), 2**62, 2**63 - 1, -(2**63)]
EDGE_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    math.nan,
    math.inf,
    -math.inf,
    5e-324,  # the smallest subnormal double
    1e-45,  # a float32 subnormal
    1e308,
    3.5e38,  # above float32's max
]
TOKEN_NAMES = ("model_input", "prompt", "target_tokens", "tokens", "stop_token_ids")


@dataclass
class Pools:
    """What the server has, planted into fields by name (refreshed before each case)."""

    model_ids: list[str]  # own target model first
    other_tenant_ids: list[str]  # another tenant's model/sampler/session ids and paths
    sampler_ids: list[str]
    session_ids: list[str]
    paths: list[str]  # treadle:// paths that exist for this tenant
    base_models: list[str]
    next_seq: int
    vocab: int
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def all_other(self) -> list[str]:
        return list(self.other_tenant_ids)


def _ids(own: list[str], pools: Pools, fake: str) -> st.SearchStrategy[str]:
    # mostly the caller's own ids, so a case gets past the lookup to the checks behind it
    return st.sampled_from([*own * 24, *pools.other_tenant_ids, fake, "", *ODD_TEXT[:6]])


def _string_for(f: FieldDescriptor, pools: Pools) -> st.SearchStrategy[str]:
    name = f.name
    if name.endswith("model_id"):
        return _ids(pools.model_ids, pools, "m-00000000deadbeef")
    if name.endswith("sampler_id"):
        return _ids(pools.sampler_ids, pools, "s-00000000deadbeef")
    if name.endswith("session_id"):
        return _ids(pools.session_ids, pools, "sess-00000000deadbeef")
    if name == "base_model":
        return st.sampled_from([*pools.base_models, "no-such-base"]) | st.sampled_from(ODD_TEXT)
    if name in ("path", "weights", "from_state") or name.endswith("_path"):
        own = pools.model_ids[0]
        crafted = [
            f"treadle://{own}/state/..",
            f"treadle://{own}/state/../../x",
            f"treadle://{own}/state/a\x00b",
            f"treadle://{own}/state/a/b",
            f"treadle://{own}/state//etc/passwd",
            "treadle://../state/x",
            f"treadle://{own}/v/-1",
            f"treadle://{own}/v/99999999999999999999",
            f"treadle://{own}/latest",
            f"tinker://{own}/state/x",
            "/etc/passwd",
        ]
        return st.sampled_from([*pools.paths, *crafted, *pools.other_tenant_ids]) | st.sampled_from(
            ODD_TEXT
        )
    if name in ("name", "dtype") or name.endswith("_name"):
        known = ["ckpt", "float32", "bfloat16", "float64", "nope"]
        return st.sampled_from(known + ODD_TEXT)
    return st.sampled_from(ODD_TEXT) | st.text(max_size=40)


def _int_for(f: FieldDescriptor, pools: Pools) -> st.SearchStrategy[int]:
    bits = 32 if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32) else 64
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if f.type in UINT_TYPES:
        lo, hi = 0, 2**bits - 1
    clip = st.integers(lo, hi)
    if f.name == "seq_id":
        n = pools.next_seq
        rel = [n, n, n - 1, n + 1, n + 3, 1, 0, -1]  # next, repeat, skip, back
        return st.sampled_from([v for v in rel if lo <= v <= hi])
    edge = [v for v in EDGE_INTS if lo <= v <= hi]
    small = st.integers(max(lo, -3), min(hi, 16))
    if f.name.endswith("_ids") or "token" in f.name:
        small = st.integers(max(lo, -3), min(hi, pools.vocab + 3))
    return st.one_of(small, st.sampled_from(edge), clip)


def _float_strategy() -> st.SearchStrategy[float]:
    return st.sampled_from(EDGE_FLOATS) | st.floats(-4.0, 4.0)


def _tensor(name: str, pools: Pools, length: int) -> st.SearchStrategy[dict[str, Any]]:
    """A ``Tensor``: usually the right dtype and shape for ``name``, sometimes not."""
    is_tokens = name in TOKEN_NAMES

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        n = draw(st.sampled_from([length] * 6 + [0, length + 1, max(0, length - 1)]))
        good = [3, 3, 3, 2] if is_tokens else [1, 1, 1, 5]
        dtype = draw(st.sampled_from(good * 3 + [0, 4, 7, 2 if not is_tokens else 1]))
        shape = draw(st.sampled_from([[n]] * 8 + [[], [1, n], [-1], [2**40]]))
        if dtype in (2, 3):
            in_range = st.sampled_from([5, 6, 7, 40]) | st.integers(0, pools.vocab - 1)
            outside = st.sampled_from([-1, pools.vocab, 2**31 - 1, -(2**31)])
            tokens = in_range if draw(st.booleans()) else in_range | outside
            values = draw(st.lists(tokens, min_size=n, max_size=n))
            fmt = f"<{n}i" if dtype == 3 else f"<{n}q"
            data = struct.pack(fmt, *[max(-(2**31), min(2**31 - 1, v)) for v in values])
        elif dtype in (1, 5):
            floats = st.floats(-2.0, 2.0) if draw(st.booleans()) else _float_strategy()
            values = draw(st.lists(floats, min_size=n, max_size=n))
            with np.errstate(over="ignore"):  # 3.5e38 as float32 is inf: wanted
                data = np.asarray(values, "<f8").astype("<f4" if dtype == 1 else "<f8").tobytes()
        else:
            data = draw(st.binary(max_size=4 * n + 3))
        if draw(st.integers(0, 19)) == 0:
            data = data[: draw(st.integers(0, len(data)))]  # ragged bytes
        return {"data": data, "dtype": dtype, "shape": shape}

    return build()


def _is_tensor(d: Descriptor) -> bool:
    return d.name == "Tensor"


@st.composite
def message_values(
    draw: st.DrawFn, desc: Descriptor, pools: Pools, depth: int = 0, length: int = 4
) -> dict[str, Any]:
    """Field values for ``desc`` (a dict ``ParseDict``-like, filled by ``fill``)."""
    out: dict[str, Any] = {}
    if any(_is_tensor(f.message_type) for f in desc.fields if f.message_type is not None):
        # one length per message, so tokens, targets, weights and advantages
        # agree unless a tensor draws a mismatch
        length = draw(st.sampled_from([1, 3, 4, 8]) | st.integers(0, 40))
    for f in desc.fields:
        if draw(st.integers(0, 4)) == 4:  # the simplest case sets every field
            continue  # missing field
        out[f.name] = draw(_field_value(f, pools, depth, length))
    return out


def _field_value(f: FieldDescriptor, pools: Pools, depth: int, length: int) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        if key_f.type == FD.TYPE_STRING:
            keys = st.sampled_from(
                ["target_tokens", "weights", "logprobs", "advantages", "clip_low_threshold", "x"]
            ) | st.sampled_from(ODD_TEXT)
        else:
            keys = _scalar(key_f, pools)
        if val_f.message_type is not None and _is_tensor(val_f.message_type):
            usual = st.sampled_from(
                [
                    ["target_tokens", "weights"],
                    ["target_tokens", "weights", "advantages", "logprobs"],
                ]
            )
            return (usual | st.lists(keys, max_size=5, unique=True)).flatmap(
                lambda d: st.fixed_dictionaries({k: _tensor(k, pools, length) for k in d})
            )
        return st.dictionaries(keys, _single(val_f, pools, depth, length), max_size=4)
    one = _single(f, pools, depth, length)
    if not f.is_repeated:
        return one
    big = 5000 if f.message_type is None else 40  # an oversized repeated field
    return st.one_of(
        st.lists(one, max_size=3),
        st.just([]),
        st.integers(big, big).flatmap(lambda n: one.map(lambda v: [v] * n)),
    )


def _single(f: FieldDescriptor, pools: Pools, depth: int, length: int) -> st.SearchStrategy:
    if f.message_type is not None:
        if _is_tensor(f.message_type):
            return _tensor(f.name, pools, length)
        if depth >= 3:
            return st.just({})
        return message_values(f.message_type, pools, depth + 1, length)
    return _scalar(f, pools)


def _scalar(f: FieldDescriptor, pools: Pools) -> st.SearchStrategy:
    if f.type == FD.TYPE_STRING:
        return _string_for(f, pools)
    if f.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type in FLOAT_TYPES:
        return _float_strategy()
    if f.type == FD.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return st.sampled_from(known) | st.sampled_from([99, -1, 2**31 - 1])  # unknown values
    return _int_for(f, pools)


def fill(msg: Message, values: dict[str, Any]) -> Message:
    """Set ``values`` on ``msg`` (unknown enum numbers are kept: proto3 enums are open)."""
    for name, value in values.items():
        f = msg.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            val_f = f.message_type.fields_by_name["value"]
            for k, v in value.items():
                if val_f.message_type is not None:
                    fill(target[k], v)
                else:
                    target[k] = v
        elif f.is_repeated:
            for v in value:
                fill(target.add(), v) if f.message_type is not None else target.append(v)
        elif f.message_type is not None:
            fill(target, value)
            target.SetInParent()
        else:
            setattr(msg, name, value)
    return msg


def build(desc: Descriptor, values: dict[str, Any]) -> Message:
    return fill(message_factory.GetMessageClass(desc)(), values)


# ---- raw-byte mutations -------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def mutate(draw: st.DrawFn, desc: Descriptor, payload: bytes, max_bytes: int) -> tuple[str, bytes]:
    """(kind, bytes): usually the message as is; else broken at the wire level."""
    kind = draw(
        st.sampled_from(
            ["as_is"] * 12 + ["wrong_wire_type", "truncate", "junk", "random", "oversize"]
        )
    )
    if kind == "wrong_wire_type" and desc.fields:
        f = draw(st.sampled_from(list(desc.fields)))
        wire = draw(st.sampled_from([0, 1, 2, 5]))  # varint, fixed64, bytes, fixed32
        body = {0: _varint(2**63), 1: b"\xff" * 8, 2: _varint(3) + b"\x80\x80\x80", 5: b"\x01" * 4}
        return kind, payload + _varint((f.number << 3) | wire) + body[wire]
    if kind == "truncate" and payload:
        return kind, payload[: draw(st.integers(0, len(payload) - 1))]
    if kind == "junk":
        return kind, payload + draw(st.binary(min_size=1, max_size=32))
    if kind == "random":
        return kind, draw(st.binary(max_size=64))
    if kind == "oversize":
        # an unknown length-delimited field: well-formed, just over the limit
        pad = max_bytes + 1
        return kind, payload + _varint((9999 << 3) | 2) + _varint(pad) + b"\0" * pad
    return "as_is", payload
