"""Weights in shared memory for the sampler process (``workers.sampler.process.shm``): one buffer
per version, passed without a second copy, and buffers reused once free."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from treadle.workers.model.streamed_file import Entry
from treadle.workers.sampler.process import shm
from treadle.workers.sampler.process.shm import flatten, shared_fill


def _shared_fill(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """``shared_fill`` handed ``named`` one tensor at a time."""
    entries = [Entry.of(k, t) for k, t in named.items()]
    return shared_fill(entries, iter(named.items()))


def test_shared_fill_is_shipped_without_a_second_copy() -> None:
    """``shared_fill`` puts detached copies, one at a time as they come, in one shared
    buffer, which ``flatten`` then passes as it is; other tensors are copied into a
    new one; a tensor unlike its entry is refused."""
    src = {"a": torch.randn(3, 4, requires_grad=True), "b": torch.randn(5)}
    shared = _shared_fill(src)
    for k, t in src.items():
        assert torch.equal(shared[k], t) and not shared[k].requires_grad
    storage = shared["a"].untyped_storage()
    assert storage.is_shared() and shared["b"].untyped_storage().data_ptr() == storage.data_ptr()
    with torch.no_grad():
        src["a"].add_(1.0)  # the live weights move on; the copy does not
    assert not torch.equal(shared["a"], src["a"])
    buf, layout = flatten(shared)  # type: ignore[misc]
    assert buf.untyped_storage().data_ptr() == storage.data_ptr()  # no copy
    assert layout == [("a", (3, 4), 0), ("b", (5,), 12)]
    # not one shared buffer (separate tensors, or out of order): copied
    for named in ({k: t.detach() for k, t in src.items()}, {"b": shared["b"], "a": shared["a"]}):
        buf2, _ = flatten(named)  # type: ignore[misc]
        assert buf2.untyped_storage().data_ptr() != storage.data_ptr()
        assert torch.equal(buf2[:5], named[next(iter(named))].reshape(-1)[:5])
    mixed = _shared_fill({"a": torch.ones(2), "i": torch.arange(3)})  # two dtypes: clones
    assert torch.equal(mixed["i"], torch.arange(3)) and not mixed["a"].is_shared()
    entries = [Entry.of("a", src["a"]), Entry.of("b", src["b"])]
    with pytest.raises(ValueError, match="laid out"):
        shared_fill(entries, iter([("b", src["b"]), ("a", src["a"])]))


def test_the_pool_reuses_only_free_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer comes back only when the child returned it and nothing views it;
    where torch does not count references, the pool keeps nothing at all."""
    pool = shm.ShmPool()
    buf = pool.take(6, torch.float32)
    ptr, view = buf.data_ptr(), buf[:3]
    pool.lend(7, [buf])
    del buf  # shipped: from here on only `view` reads it on this side
    others = [pool.take(6, torch.float32)]  # held: never free while this test runs
    assert others[0].data_ptr() != ptr  # lent: not reused
    pool.returned([7])
    others.append(pool.take(6, torch.float32))
    assert others[1].data_ptr() != ptr  # returned, but still viewed
    del view
    assert pool.take(6, torch.float32).data_ptr() == ptr and pool.reused == 1
    monkeypatch.setattr(shm, "_SOLE", None)
    kept = len(pool._bufs)
    pool.take(6, torch.float32)
    assert len(pool._bufs) == kept  # not remembered: it could never be freed
