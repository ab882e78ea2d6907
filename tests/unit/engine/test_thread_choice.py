"""ThreadChoice: the engine's measured choice between one torch thread and all of them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from treadle.errors import InvalidArgumentError
from treadle.server.config import ServerConfig
from treadle.workers.device.thread_choice import ThreadChoice
from treadle.workers.engine.flags import add_engine_flags, engine_config, engine_settings


def _drive(
    choice: ThreadChoice, calls: int, cost: dict[int, float], work: float = 1e9
) -> list[int]:
    """Run ``calls`` calls of one bucket; a call on n threads takes ``cost[n]`` per work."""
    used = []
    for _ in range(calls):
        n = choice.threads("forward_backward", work, 2)
        choice.record("forward_backward", work, 2, n, cost[n] * work)
        used.append(n)
    return used


@pytest.mark.parametrize("faster", [1, 2])
def test_explores_both_then_keeps_the_faster(faster: int) -> None:
    choice = ThreadChoice(trials=3, recheck_every=1000)
    cost = {faster: 1.0, 3 - faster: 1.3}  # closer than `decisive` (1.5)
    used = _drive(choice, 30, cost)
    assert used[:6] == [2, 1, 2, 1, 2, 1]  # exploring, all threads first
    assert used[6:] == [faster] * 24


@pytest.mark.parametrize("faster", [1, 2])
def test_a_decisive_gap_ends_the_exploration_at_once(faster: int) -> None:
    """One timing each that differ by `decisive` decide: a 110M pass on one thread of
    two costs about twice the time, and three such trials would cost a short run
    dearly."""
    choice = ThreadChoice(trials=3, decisive=1.5, recheck_every=1000)
    used = _drive(choice, 12, {faster: 1.0, 3 - faster: 1.6})
    assert used == [2, 1] + [faster] * 10


def test_rechecks_less_often_while_the_choice_holds_and_follows_a_change() -> None:
    choice = ThreadChoice(trials=2, window=3, decisive=10.0, recheck_every=10, max_recheck_every=40)
    used = _drive(choice, 4 + 150, {1: 1.0, 2: 2.0})
    rechecks = [i - 4 for i, n in enumerate(used) if n == 2 and i >= 4]
    assert rechecks == [9, 29, 69, 109, 149]  # 10, 20, 40, then at most 40 calls apart
    # The machine changes (say, a neighbour leaves): two threads become faster.
    # Rechecks refill two threads' window; once its median wins, the choice
    # follows, and one thread is rechecked 10 calls later.
    used = _drive(choice, 150, {1: 1.0, 2: 0.5})
    switch = used.index(2, used.index(2) + 1)  # the second recheck wins the median
    assert used[switch:][:11] == [2] * 10 + [1]
    assert used[-20:].count(2) >= 19


def test_buckets_by_kind_and_size(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="treadle.engine")
    choice = ThreadChoice(trials=1, recheck_every=1000)
    _drive(choice, 4, {1: 1.0, 2: 3.0}, work=1e9)  # small: one thread
    _drive(choice, 4, {1: 3.0, 2: 1.0}, work=1e11)  # large: two
    assert choice.threads("forward_backward", 1.1e9, 2) == 1  # same half-octave
    assert choice.threads("forward_backward", 1.1e11, 2) == 2
    assert choice.threads("forward_logprobs", 1e9, 2) == 2  # a new kind explores, all first
    decided = [r.getMessage() for r in caplog.records]
    assert len(decided) == 2 and "forward_backward calls of ~1e+09" in decided[0]
    assert (
        "run on 1 (median ms per 1e9 tokens x params: 1 thread 1e+12, 2 threads 3e+12)"
        in decided[0]
    )


def test_policies_and_nothing_to_choose() -> None:
    assert ThreadChoice("all").threads("forward_backward", 1e9, 4) == 4
    assert ThreadChoice("one").threads("forward_backward", 1e12, 4) == 1
    measure = ThreadChoice()
    assert measure.threads("forward_backward", 1e9, 1) == 1  # one thread available
    assert measure.threads("optim_step", 0.0, 4) == 4  # no work to size (barriers)
    with pytest.raises(ValueError, match="thread policy"):
        ThreadChoice("fast")


def test_the_flag_reaches_the_engine_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    settings = engine_settings(parser.parse_args(["--training-threads", "one"]))
    config = ServerConfig(data_dir=tmp_path, **settings)
    assert engine_config(config, {}, None).training_threads == "one"
    assert engine_settings(parser.parse_args([]))["training_threads"] == "measure"
    with pytest.raises(InvalidArgumentError, match="training_threads: 'fast'"):
        ServerConfig(data_dir=tmp_path, training_threads="fast")


def test_a_new_size_follows_its_neighbours_where_they_settle_it() -> None:
    """More work per op only favours more threads: once a size runs on one thread, a
    smaller one does too without exploring (and once a size runs on all, a larger
    one does); where neighbours disagree, or none settles it, the size explores."""
    choice = ThreadChoice(trials=2, recheck_every=1000)
    _drive(choice, 6, {1: 1.0, 2: 3.0}, work=1e10)  # a busy host: one thread
    assert _drive(choice, 5, {1: 1.0, 2: 3.0}, work=1e8) == [1] * 5  # smaller: no trial
    assert _drive(choice, 3, {1: 3.0, 2: 1.0}, work=1e12)[:2] == [2, 1]  # larger: explores
    # now 1e12 runs on all threads and 1e10 on one: 1e11 is not settled, 1e13 is
    assert _drive(choice, 2, {1: 3.0, 2: 1.0}, work=1e11) == [2, 1]
    assert _drive(choice, 3, {1: 3.0, 2: 1.0}, work=1e13) == [2, 2, 2]
    # an inherited choice is still rechecked, and followed when the timings say so
    rechecking = ThreadChoice(trials=2, recheck_every=3)
    _drive(rechecking, 6, {1: 1.0, 2: 3.0}, work=1e10)
    used = _drive(rechecking, 12, {1: 3.0, 2: 1.0}, work=1e8)
    assert used[:5] == [1, 1, 2, 2, 2]  # inherited 1, rechecked 2, then 2 (followed)
