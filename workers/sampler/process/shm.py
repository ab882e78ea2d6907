"""Weights in shared memory, for the torch sampler's child process
(``workers.sampler.process.proxy``).

A version's tensors travel once, by reference: moved into one shared-memory
buffer (one file descriptor to pass, not one per tensor) that parent and child
both map. ``ShmPool`` reuses the buffers of versions nobody reads any more, so
a full fine-tune publishing a version every step does not fault in new pages
each time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from treadle.workers.model.streamed_file import Entry

Flat = tuple[Tensor, list[tuple[str, tuple[int, ...], int]]]


def _new_shared(numel: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(numel, dtype=dtype).share_memory_()


def flatten(
    named: dict[str, Tensor], alloc: Callable[[int, torch.dtype], Tensor] = _new_shared
) -> Flat | dict[str, Tensor]:
    """One shared-memory buffer holding every tensor (one file descriptor to pass,
    not one per tensor), with each tensor's (name, shape, offset); tensors of
    mixed dtypes travel as they are. Tensors that already are one such buffer
    (``shared_fill``) are passed as they are, without a copy."""
    tensors = list(named.values())
    if len({t.dtype for t in tensors}) != 1:
        return named
    already = _as_flat(named)
    if already is not None:
        return already
    total = sum(t.numel() for t in tensors)
    buf = alloc(total, tensors[0].dtype)
    layout, offset = [], 0
    for name, t in named.items():
        n = t.numel()
        buf[offset : offset + n].copy_(t.detach().reshape(-1))
        layout.append((name, tuple(t.shape), offset))
        offset += n
    return buf, layout


def _as_flat(named: dict[str, Tensor]) -> Flat | None:
    """``named`` as (buffer, layout) if the tensors fill one shared storage back to
    back, in order (what ``shared_fill`` makes); else None."""
    first = next(iter(named.values()))
    storage = first.untyped_storage()
    if not storage.is_shared():
        return None
    layout, offset = [], 0
    for name, t in named.items():
        same = t.untyped_storage().data_ptr() == storage.data_ptr()
        if not same or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    if offset * first.element_size() != storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype).set_(storage, 0, (offset,), (1,)), layout


def shared_fill(
    entries: Sequence[Entry],
    tensors: Iterable[tuple[str, Tensor]],
    alloc: Callable[[int, torch.dtype], Tensor] = _new_shared,
) -> dict[str, Tensor]:
    """Detached copies of ``tensors`` (named, shaped and ordered as ``entries`` say),
    each copied as it comes into its place in one shared-memory buffer laid out from
    ``entries`` at once: a full fine-tune's version made so goes to the sampler
    process without a second copy (parent and child then hold one copy of it, not
    two), and one gathered a tensor at a time is never held twice. Mixed dtypes: a
    clone of each."""
    if len({e.dtype for e in entries}) != 1:
        return {name: t.detach().clone() for name, t in tensors}
    buf = alloc(sum(math.prod(e.shape) for e in entries), entries[0].dtype)
    out: dict[str, Tensor] = {}
    offset = 0
    for name, t in tensors:  # not zip: its reused result would hold the last tensor
        if len(out) == len(entries):
            raise ValueError(f"{name} comes after the {len(out)} tensors laid out")
        e = entries[len(out)]
        if name != e.name or tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} comes where {e.name} {e.shape} is laid out")
        n = math.prod(e.shape)
        place = buf[offset : offset + n].view(e.shape)
        place.copy_(t.detach())
        out[name] = place
        offset += n
        del t  # let go before the next is asked for (on a group: gathered)
    if len(out) != len(entries):
        raise ValueError(f"{len(out)} tensors came, {len(entries)} are laid out")
    return out


def unflatten(flat: Flat | dict[str, Tensor]) -> dict[str, Tensor]:
    if isinstance(flat, dict):
        return flat
    buf, layout = flat
    out = {}
    for name, shape, offset in layout:
        n = math.prod(shape)
        out[name] = buf[offset : offset + n].view(shape)
    return out


def _storage_refs(t: Tensor) -> int | None:
    """How many references hold ``t``'s storage, as torch counts them (None where
    this torch does not tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(t.untyped_storage()._cdata))


def _calibrate() -> int | None:
    """The count of a storage held by one tensor alone, if a view adds exactly one
    (checked once, so a torch that counts otherwise turns reuse off, never on)."""
    t = torch.empty(1)
    alone = _storage_refs(t)
    view = t[:]
    with_view = _storage_refs(t)
    del view
    if alone is None or with_view != alone + 1 or _storage_refs(t) != alone:
        return None
    return alone


_SOLE = _calibrate()


def sole_holder(buf: Tensor) -> bool:
    """Whether ``buf`` is the only tensor on its storage (no view of it is alive);
    False where torch does not tell (then nothing is reused)."""
    return _SOLE is not None and _storage_refs(buf) == _SOLE


class ShmPool:
    """The shared-memory buffers of published versions, reused once nobody reads them.

    A new shared buffer costs its page faults on the first write: 10.4 ms for a
    17.6 MB buffer (the 5M model) here, against 0.5 ms to copy into one already
    mapped. A full fine-tune publishes a version every step, so each new version
    goes into a buffer of an old one that nobody reads any more, when there is
    one. A buffer is *lent* while the child may read it (shipped under a
    snapshot key, until the child reports the key released: no tensor of its
    own on it any more), and free once it is not lent and the parent holds no
    view of it either (the version store let the version go). At most ``keep``
    free ones are kept.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._bufs: dict[int, Tensor] = {}  # data_ptr -> every buffer handed out, kept
        self._lent: dict[int, list[int]] = {}  # snapshot key -> data_ptrs the child may read
        self.reused = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if _SOLE is None:  # no way to tell when a buffer is free: never keep one
            return _new_shared(numel, dtype)
        with self._lock:
            lent = {p for ptrs in self._lent.values() for p in ptrs}
            free = [p for p, b in self._bufs.items() if p not in lent and sole_holder(b)]
            for p in free:
                b = self._bufs[p]
                if b.numel() == numel and b.dtype == dtype:
                    self.reused += 1
                    return b[:]
            for p in free[: max(0, len(free) - self.keep)]:
                del self._bufs[p]  # unmapped as the last tensor on it goes
            buf = _new_shared(numel, dtype)
            self._bufs[buf.data_ptr()] = buf
            # a view, never the pool's own tensor: whoever holds it counts as a reader
            return buf[:]

    def lend(self, skey: int, bufs: list[Tensor]) -> None:
        with self._lock:
            self._lent[skey] = [b.data_ptr() for b in bufs]

    def returned(self, skeys: Sequence[int]) -> None:
        with self._lock:
            for skey in skeys:
                self._lent.pop(skey, None)

    def forget_child(self) -> None:
        """A new child holds nothing: no buffer is lent any more."""
        with self._lock:
            self._lent.clear()


def shipped_buffers(params: Any, adapter: Any) -> list[Tensor]:
    """The shared buffers a snapshot message carries: its params' and its adapter's
    (each a ``Flat``, or tensors sent one by one, or None)."""
    flats = [params, None if adapter is None else adapter[0]]
    return [f[0] for f in flats if isinstance(f, tuple)]
