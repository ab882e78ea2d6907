"""The HTTP futures' bookkeeping: a finished result is dropped ``keep_s`` after it
finished, with its ``once`` key, and starting a call does not scan every held
result (O(1) amortised: the results expire from a queue in finishing order)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from treadle.server.http.errors import GoneError
from treadle.server.http.futures import Futures


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _NoScan(dict):  # type: ignore[type-arg]
    """The entries' dict, refusing to be walked: a lookup is fine, a scan is not."""

    def _scan(self, *args: Any) -> Any:
        raise AssertionError("Futures walked every held entry")

    items = values = keys = __iter__ = _scan


async def _value(v: int) -> int:
    return v


def _encode(v: int) -> dict[str, Any]:
    return {"v": v}


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_results_expire_keep_s_after_they_finished_with_their_keys() -> None:
    async def main() -> None:
        clock = _Clock()
        futures = Futures(keep_s=60.0, clock=clock)
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        pending = futures.start("t", never, _encode)  # first in, never finishes
        old = [futures.start("t", _value(i), _encode) for i in range(3)]
        keyed = futures.once("t", ("create", "s:train:0"), lambda: _value(9), _encode)
        await _settle()
        clock.now += 30.0
        young = futures.start("t", _value(5), _encode)
        await _settle()
        assert (await futures.retrieve("t", old[0])).status_code == 200
        clock.now += 31.0  # the first four are 61 s old, the young one 31 s
        futures.start("t", _value(6), _encode)  # expiry happens on a call's start
        for rid in [*old, keyed]:
            with pytest.raises(GoneError):
                await futures.retrieve("t", rid)
        assert ("t", "create", "s:train:0") not in futures._keys
        assert (await futures.retrieve("t", young)).status_code == 200
        assert futures.cancel("t", pending)  # unfinished: never expired

    asyncio.run(main())


def test_starting_a_call_does_not_scan_the_held_results() -> None:
    async def main() -> None:
        clock = _Clock()
        futures = Futures(keep_s=60.0, clock=clock)
        futures._entries = _NoScan()
        first = [futures.start("t", _value(i), _encode) for i in range(50)]
        await _settle()
        clock.now += 61.0
        futures.start("t", _value(0), _encode)
        assert not any(rid in futures._entries for rid in first)
        assert dict.__len__(futures._entries) == 1

    asyncio.run(main())
