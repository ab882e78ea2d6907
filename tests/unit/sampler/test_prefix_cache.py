"""The staging slots and prefix reuse (``workers.sampler.prefix_cache``), without a model."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from treadle.common.engine.domain import SampleOp, SamplingConfig
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.prefix_cache import MIN_PREFIX_WAIT, PrefixCache
from treadle.workers.sampler.state import TorchRequest


class _Stage:
    """A staging cache that records the KV moves and clears it is asked for."""

    def __init__(self, slots: int) -> None:
        self.num_slots = slots
        self.max_len = 64
        self.moves: list[tuple[list[int], list[int], int]] = []
        self.clears: list[tuple[range, int, int]] = []

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        self.moves.append((src, dst, length))

    def clear(self, slots: range, stop: int, start: int = 0) -> None:
        if stop > start:
            self.clears.append((slots, start, stop))


class _Params:
    """Stands for a version's weights: only its identity matters here."""


WEIGHTS = WeightSnapshot(None, 0, _Params(), None)  # type: ignore[arg-type]
OTHER = WeightSnapshot("m", 1, _Params(), None)  # type: ignore[arg-type]


def _request(prompt: np.ndarray, snap: WeightSnapshot = WEIGHTS) -> TorchRequest:
    op = SampleOp(prompt, 1, SamplingConfig())
    return TorchRequest(SampleJob(Any, op, snap), Future(), frozenset(), 0, prompt)  # type: ignore[arg-type]


def _prefill(cache: PrefixCache, req: TorchRequest, clock: int) -> None:
    """What the sampler does with a slot: the whole prompt prefilled, then released."""
    cache.writing([(req, req.prompt.size - req.prefilled)])
    req.prefilled = req.prompt.size
    cache.advanced(req, clock)
    cache.release(req)


def test_a_prompt_reuses_the_longest_staged_prefix_under_the_same_weights() -> None:
    cache = PrefixCache(_Stage(2))  # type: ignore[arg-type]
    first = _request(np.arange(40))
    assert cache.slot_for(first, clock=1) >= 0 and first.reused == 0
    _prefill(cache, first, 1)
    same_start = _request(np.concatenate([np.arange(30), [99, 98]]))
    slot = cache.slot_for(same_start, clock=2)
    assert slot == first.stage_slot and same_start.reused == 30
    # another weight version computed none of it
    other = _request(np.arange(40), OTHER)
    assert cache.slot_for(other, clock=3) >= 0 and other.reused == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    cache = PrefixCache(_Stage(2))  # type: ignore[arg-type]
    first = _request(np.arange(20))
    cache.slot_for(first, clock=1)
    _prefill(cache, first, 1)
    again = _request(np.arange(20))
    cache.slot_for(again, clock=2)
    assert again.reused == 19  # its logits choose the first sampled token


def test_a_request_waits_for_a_long_shared_prefix_being_prefilled() -> None:
    cache = PrefixCache(_Stage(2))  # type: ignore[arg-type]
    running = _request(np.arange(MIN_PREFIX_WAIT + 10))
    assert cache.slot_for(running, clock=1) >= 0  # prefilling now, owns its slot
    twin = _request(np.arange(MIN_PREFIX_WAIT + 10))
    assert cache.slot_for(twin, clock=2) == -1  # worth waiting for: copy, not recompute
    unrelated = _request(np.arange(50, 60))
    assert cache.slot_for(unrelated, clock=2) >= 0
    assert cache.slot_for(_request(np.arange(70, 80)), clock=3) == -1  # no free slot


def test_a_prefix_in_a_busy_slot_is_moved_to_a_free_one() -> None:
    stage = _Stage(3)
    cache = PrefixCache(stage)  # type: ignore[arg-type]
    first = _request(np.arange(12))
    cache.slot_for(first, clock=1)
    first.prefilled = 8  # partly prefilled, still owned
    cache.advanced(first, 1)
    cache.release(first)
    holder = _request(np.arange(100, 110))
    cache.slot_for(holder, clock=2)
    # first's slot is free again; make it busy with a new owner that shares nothing
    cache.staged[first.stage_slot].owner = holder  # type: ignore[assignment]
    later = _request(np.concatenate([np.arange(8), [77]]))
    slot = cache.slot_for(later, clock=3)
    assert slot not in (first.stage_slot, -1) and later.reused == 8
    assert stage.moves == [([first.stage_slot], [slot], 8)]


def test_a_slot_is_zeroed_beyond_the_prefix_its_next_prompt_reuses() -> None:
    """What a former prompt wrote past the part the next one reuses goes back to zeros
    (a padded prefill batch reads every slot up to its longest prompt), and only that."""
    stage = _Stage(1)
    cache = PrefixCache(stage)  # type: ignore[arg-type]
    first = _request(np.arange(40))
    cache.slot_for(first, clock=1)
    assert stage.clears == []  # a fresh slot holds zeros
    _prefill(cache, first, 1)
    same_start = _request(np.concatenate([np.arange(30), [99, 98]]))
    assert cache.slot_for(same_start, clock=2) == 0 and same_start.reused == 30
    assert stage.clears == [(range(1), 30, 40)]
    _prefill(cache, same_start, 2)
    other = _request(np.arange(40), OTHER)  # other weights: nothing reused
    cache.slot_for(other, clock=3)
    assert stage.clears[1:] == [(range(1), 0, 32)]
