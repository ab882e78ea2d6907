"""Where a sampler samples (``treadle.server.sampler_placement``): the server's
``--sampler-placement`` unless the sampler chose its own at creation; ``pool`` with
no sampler worker for the base is UNAVAILABLE naming the base and what asked for
the pool. And the placement on the wire, both ways: the same field type and the same
conversion for every request that makes a sampler (``CreateSampler``, ``SyncWeights``)."""

from __future__ import annotations

import pytest

from treadle import _convert
from treadle.common.engine.domain import SAMPLER_PLACEMENTS
from treadle.errors import InvalidArgumentError, UnavailableError
from treadle.server.rpc import convert
from treadle.server.sampler_placement import samples_on_pool
from treadle.v1 import sampling_pb2, training_pb2


@pytest.mark.parametrize(
    ("server", "chosen", "pool_serves", "on_pool"),
    [
        ("colocated", "", True, False),
        ("auto", "", True, True),
        ("auto", "", False, False),
        ("pool", "", True, True),
        # the sampler's own choice wins over the server's
        ("pool", "colocated", True, False),
        ("colocated", "pool", True, True),
        ("colocated", "auto", True, True),
        ("colocated", "auto", False, False),
        ("pool", "auto", False, False),
    ],
)
def test_the_sampler_choice_wins_over_the_server(
    server: str, chosen: str, pool_serves: bool, on_pool: bool
) -> None:
    assert samples_on_pool(server, chosen, "tiny", pool_serves) is on_pool


def test_pool_without_a_sampler_worker_names_the_base_and_who_asked() -> None:
    with pytest.raises(UnavailableError, match="base model 'tiny' \\(--sampler-placement pool\\)"):
        samples_on_pool("pool", "", "tiny", False)
    with pytest.raises(UnavailableError, match="base model 'tiny' \\(the sampler's placement pool"):
        samples_on_pool("colocated", "pool", "tiny", False)
    with pytest.raises(UnavailableError, match="base model 'tiny' \\(the sampler's placement pool"):
        samples_on_pool("auto", "pool", "tiny", False)


@pytest.mark.parametrize("placement", SAMPLER_PLACEMENTS)
def test_placement_round_trips_the_wire(placement: str) -> None:
    request = _convert.create_sampler_request("tiny", None, placement)
    source = convert.sampler_source(
        sampling_pb2.CreateSamplerRequest.FromString(request.SerializeToString())
    )
    assert (source.base_model, source.placement) == ("tiny", placement)


def test_every_wire_placement_is_a_domain_one() -> None:
    named = {
        convert.sampler_placement(v)
        for v in sampling_pb2.SamplerPlacement.values()
        if v != sampling_pb2.SAMPLER_PLACEMENT_UNSPECIFIED
    }
    assert named == set(SAMPLER_PLACEMENTS) == set(_convert.SAMPLER_PLACEMENTS)


def test_unset_placement_is_the_servers() -> None:
    request = _convert.create_sampler_request(None, "treadle://m-1/latest")
    assert request.placement == sampling_pb2.SAMPLER_PLACEMENT_UNSPECIFIED
    assert convert.sampler_source(request).placement == ""


def test_unknown_placement_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match="placement: unknown sampler placement \\(9\\)"):
        convert.sampler_source(sampling_pb2.CreateSamplerRequest(base_model="tiny", placement=9))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="placement: 'poool' is not one of"):
        _convert.create_sampler_request("tiny", None, "poool")


@pytest.mark.parametrize("placement", [None, *SAMPLER_PLACEMENTS])
def test_a_syncs_sampler_takes_the_same_placement_field(placement: str | None) -> None:
    request = _convert.sync_weights_request("m-1", False, placement)
    wire = training_pb2.SyncWeightsRequest.FromString(request.SerializeToString())
    assert wire.create_sampler
    assert wire.placement == _convert.create_sampler_request("tiny", None, placement).placement
    assert convert.sampler_placement(wire.placement) == (placement or "")


def test_a_syncs_unknown_placement_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match="placement: 'poool' is not one of"):
        _convert.sync_weights_request("m-1", False, "poool")
