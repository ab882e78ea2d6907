"""When decode runs on prepacked weights (``workers.sampler.prepack_policy``), with the
packing itself stubbed out: which batches pack, how many filler rows, and that
at most ``MAX_PACKED`` versions stay packed. ``test_prepack.py`` runs the real
packing."""

from __future__ import annotations

import pytest

from treadle.workers.sampler import prepack_policy
from treadle.workers.sampler.prepack_policy import MAX_PACKED, PrepackPolicy


class _Weights:
    """Stands for one version's weights; ``rows`` is what it is packed for."""

    rows: int | None = None


@pytest.fixture
def fake_prepack(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    knobs: dict[str, object] = {"method": "mkl", "min_rows": 4, "after": 2, "unpacked": []}
    pp = prepack_policy.prepack
    monkeypatch.setattr(pp, "available", lambda params: True)
    monkeypatch.setattr(pp, "method_for", lambda params, width: knobs["method"])
    monkeypatch.setattr(pp, "min_rows", lambda params, width: knobs["min_rows"])
    monkeypatch.setattr(pp, "pack_after", lambda params, width: knobs["after"])
    monkeypatch.setattr(pp, "packed_rows", lambda params: params.rows)
    monkeypatch.setattr(pp, "prepack", lambda params, width: setattr(params, "rows", width))

    def unpack(params: _Weights) -> None:
        params.rows = None
        knobs["unpacked"].append(params)  # type: ignore[attr-defined]

    monkeypatch.setattr(pp, "unpack", unpack)
    return knobs


def test_off_never_packs(fake_prepack: dict[str, object]) -> None:
    policy = PrepackPolicy(enabled=False, width=8)
    w = _Weights()
    assert [policy.pad_rows(w, 8, 8) for _ in range(5)] == [0] * 5
    assert w.rows is None and policy.packs_for(1) and policy.packed == 0


def test_mkl_packs_full_batches_after_the_weights_lasted(fake_prepack: dict[str, object]) -> None:
    policy = PrepackPolicy(enabled=True, width=8)
    w = _Weights()
    assert policy.pad_rows(w, 8, 8) == 0 and w.rows is None  # first step: may not last
    assert policy.pad_rows(w, 7, 7) == 1 and w.rows == 8  # 1/8 short: one filler row
    assert policy.pad_rows(w, 6, 6) == 0  # more than 1/8 short: plain
    assert policy.pad_rows(w, 7, 8) == 0  # not every running row: no free slots to fill


def test_onednn_packs_wide_batches_without_filler(fake_prepack: dict[str, object]) -> None:
    fake_prepack["method"] = "onednn"
    policy = PrepackPolicy(enabled=True, width=8)
    w = _Weights()
    policy.pad_rows(w, 8, 8)
    assert policy.pad_rows(w, 5, 8) == 0 and w.rows == 8
    assert policy.packs_for(4) and not policy.packs_for(3)


def test_only_the_newest_versions_stay_packed(fake_prepack: dict[str, object]) -> None:
    fake_prepack["after"] = 0
    policy = PrepackPolicy(enabled=True, width=8)
    versions = [_Weights() for _ in range(MAX_PACKED + 2)]
    for w in versions:
        policy.pad_rows(w, 8, 8)
    assert policy.packed == MAX_PACKED
    assert fake_prepack["unpacked"] == versions[:2]
    assert [w.rows for w in versions] == [None, None] + [8] * MAX_PACKED
