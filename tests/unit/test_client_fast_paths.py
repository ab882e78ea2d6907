"""The SDK's fast paths for plain Python lists (rollouts, datums, wire tensors) give
what the general numpy paths give: the same values, the same bytes, the same errors."""

from __future__ import annotations

import numpy as np
import pytest

from treadle import _convert
from treadle import types as types_module
from treadle.errors import InvalidArgumentError
from treadle.rl import Rollout, build_datums
from treadle.rl import staleness as staleness_module
from treadle.rl.staleness import count_versions, expand_versions, rollout_staleness, token_staleness
from treadle.types import Datum, ModelInput, VersionSpan
from treadle.v1 import common_pb2, sampling_pb2
from treadle.wire.tensors import from_wire, ints_to_wire, to_wire


def _bytes(msg: common_pb2.Tensor) -> bytes:
    return msg.SerializeToString(deterministic=True)


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, 3], (4, 5), [], [np.int64(7), np.int32(8)], [True, 2], [2**62, -(2**62)]],
)
def test_ints_to_wire_matches_numpy(tokens: list) -> None:
    assert _bytes(ints_to_wire(tokens)) == _bytes(to_wire(np.asarray(tokens, dtype=np.int64)))


def test_ints_to_wire_falls_back_to_numpy_for_other_values() -> None:
    # floats are truncated by numpy's conversion, as before the fast path
    assert _bytes(ints_to_wire([1.7, 2.2])) == _bytes(to_wire(np.asarray([1, 2], dtype=np.int64)))
    with pytest.raises(OverflowError):
        ints_to_wire([2**64])
    reused = to_wire(np.zeros((2, 3), dtype=np.float32))  # an old shape is replaced
    assert list(ints_to_wire([1, 2, 3, 4], reused).shape) == [4]


def test_to_wire_replaces_the_shape_of_a_reused_tensor() -> None:
    msg = to_wire(np.zeros((2, 3), dtype=np.float32))
    to_wire(np.arange(5), msg)
    assert list(msg.shape) == [5] and msg.dtype == common_pb2.INT64
    np.testing.assert_array_equal(from_wire(msg, "x"), np.arange(5))


def test_from_wire_checks_one_dimension_as_before() -> None:
    msg = to_wire(np.arange(4, dtype=np.int32))
    msg.shape[:] = [5]
    with pytest.raises(InvalidArgumentError, match=r"x: shape \[5\] does not match 4 elements"):
        from_wire(msg, "x")
    msg.shape[:] = [-4]
    with pytest.raises(InvalidArgumentError, match=r"shape \[-4\] does not match 4"):
        from_wire(msg, "x")
    del msg.shape[:]
    assert from_wire(msg, "x").tolist() == [0, 1, 2, 3]
    msg.shape[:] = [2, 2]
    assert from_wire(msg, "x").shape == (2, 2)


def test_sequence_from_wire_gives_python_values() -> None:
    seq = sampling_pb2.SampledSequence()
    to_wire(np.array([3, 4], dtype=np.int32), seq.tokens)
    to_wire(np.array([-0.5, -1.25], dtype=np.float32), seq.logprobs)
    out = _convert.sequence_from_wire(seq, "s")
    assert out.tokens == [3, 4] and all(type(t) is int for t in out.tokens)
    assert out.logprobs == [-0.5, -1.25] and all(type(x) is float for x in out.logprobs)


@pytest.mark.parametrize(
    "versions",
    [
        [VersionSpan(0, 2, 1), VersionSpan(2, 3, 2)],
        [VersionSpan(0, 0, 1)],
        [1, 2, 3],
        (np.int64(4),),
    ],
)
def test_count_versions_is_the_expanded_length(versions: list) -> None:
    assert count_versions(versions) == len(expand_versions(versions))


@pytest.mark.parametrize(
    "versions",
    [
        [VersionSpan(1, 2, 1)],
        [VersionSpan(0, 2, 1), VersionSpan(3, 1, 1)],
        [VersionSpan(0, -1, 1)],
        [VersionSpan(0, 1, 1), 3],
        [-1],
    ],
)
def test_count_versions_raises_what_expand_versions_raises(versions: list) -> None:
    with pytest.raises(InvalidArgumentError) as expected:
        expand_versions(versions, field_name="rollout.versions")
    with pytest.raises(InvalidArgumentError) as got:
        count_versions(versions, field_name="rollout.versions")
    assert str(got.value) == str(expected.value)


def test_rollout_from_lists_equals_rollout_from_arrays() -> None:
    lists = Rollout([1, 2], [3, 4, 5], [-0.1, -0.2, -3], 1.0, [VersionSpan(0, 3, 2)], [-1, 0, -2])
    arrays = Rollout(
        np.array([1, 2]),
        np.array([3, 4, 5]),
        np.array([-0.1, -0.2, -3.0]),
        1.0,
        [VersionSpan(0, 3, 2)],
        np.array([-1.0, 0.0, -2.0]),
    )
    assert lists == arrays
    assert all(type(x) is float for x in lists.completion_logprobs + lists.ref_logprobs)


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        ([-0.1, float("nan")], "rollout.completion_logprobs: contains NaN or inf"),
        ([-0.1], "rollout.completion_logprobs: 1 values for 2 completion tokens"),
        ([[-0.1, -0.2]], "rollout.completion_logprobs: expected a 1-D sequence"),
        (["x", "y"], "rollout.completion_logprobs: cannot convert to float64"),
        ([-0.1, 10**400], "int too large"),
    ],
)
def test_rollout_errors_are_kept(logprobs: list, message: str) -> None:
    with pytest.raises((InvalidArgumentError, OverflowError), match=message):
        Rollout([1], [2, 3], logprobs)


def test_masked_datum_keeps_the_sign_of_a_masked_negative_advantage() -> None:
    rollout = Rollout([1], [2, 3], [-0.5, -0.5], mask=[1, 0])
    (datum,) = build_datums([rollout], [-2.0], aggregation="sum")
    adv = datum.loss_fn_inputs["advantages"]
    assert adv.tolist() == [-2.0, 0.0] and np.signbit(adv[1])  # -2 x 0 = -0.0, as before
    assert datum.loss_fn_inputs["weights"].dtype == np.float32


def test_datum_keeps_a_float64_or_converts_other_inputs() -> None:
    f64 = np.zeros(2)
    datum = Datum(ModelInput((1, 2)), {"weights": f64, "target_tokens": [3, 4], "x": [0.5, 1]})
    assert datum.loss_fn_inputs["weights"] is f64
    assert datum.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert datum.loss_fn_inputs["x"].dtype == np.float32
    with pytest.raises(InvalidArgumentError, match="loss_fn_inputs.x: expected a 1-D"):
        Datum(ModelInput((1,)), {"x": np.zeros((1, 2), dtype=np.float32)})


def test_rollout_takes_finite_values_whose_sum_overflows() -> None:
    rollout = Rollout([1], [2, 3], [-1e308, -1e308], ref_logprobs=[1e308, 1e308])
    assert rollout.completion_logprobs == (-1e308, -1e308)
    with pytest.raises(InvalidArgumentError, match="ref_logprobs: contains NaN or inf"):
        Rollout([1], [2, 3], [0.0, 0.0], ref_logprobs=[1e308, float("inf")])


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, 3], (4, 5), [], [np.int64(7), np.int32(8)], [True, 2], [2**63 - 1, -(2**63)]],
)
def test_model_input_from_a_token_list_skips_numpy(tokens: list, monkeypatch) -> None:
    expected = tuple(int(t) for t in np.asarray(tokens, dtype=np.int64))
    # other values convert as numpy does, as before
    assert ModelInput.from_ints([1.7, "3", np.bool_(True)]).tokens == (1, 3, 1)
    with pytest.raises(OverflowError):
        ModelInput.from_ints([2**63])
    with pytest.raises(InvalidArgumentError, match="model_input.tokens: expected a 1-D"):
        ModelInput.from_ints([[1, 2]])
    monkeypatch.setattr(types_module, "to_numpy", _refuse)
    got = ModelInput.from_ints(tokens).tokens
    assert got == expected and all(type(t) is int for t in got)


@pytest.mark.parametrize(
    "versions",
    [
        [VersionSpan(0, 2, 5)],
        [VersionSpan(0, 1, 3), VersionSpan(1, 0, 1), VersionSpan(1, 2, 6)],
        (VersionSpan(0, 1, 7), VersionSpan(1, 1, 4)),
    ],
)
def test_rollout_staleness_of_spans_skips_the_per_token_array(versions, monkeypatch) -> None:
    n = count_versions(versions)
    rollout = Rollout([1], list(range(2, 2 + n)), [0.0] * n, versions=versions)
    expected = [int(token_staleness(versions, v).max()) for v in (7, np.int64(9))]
    older = max(span.version for span in versions if span.length) - 1  # than a token
    with pytest.raises(InvalidArgumentError) as newer:
        token_staleness(versions, older)
    monkeypatch.setattr(staleness_module, "expand_versions", _refuse)
    assert [rollout_staleness(rollout, v) for v in (7, np.int64(9))] == expected
    with pytest.raises(InvalidArgumentError) as got:
        rollout_staleness(rollout, older)
    assert str(got.value) == str(newer.value)
    with pytest.raises(InvalidArgumentError, match="current_version: must be an integer >= 0"):
        rollout_staleness(rollout, -1)


def test_rollout_staleness_of_per_token_versions_is_unchanged() -> None:
    rollout = Rollout([1], [2, 3], [0.0, 0.0], versions=[6, np.int64(4)])
    assert rollout_staleness(rollout, 7) == 3
    with pytest.raises(InvalidArgumentError, match="a token has version 6, newer than"):
        rollout_staleness(rollout, 5)


def _refuse(*args, **kwargs):
    raise AssertionError("the general path was taken")
