"""How the engine's process allocates host memory: "reuse" (the default) keeps
what a step frees for the next step; "system" leaves malloc as it is.

On the CPU, torch takes its tensors from the C library's malloc. glibc maps a
block over its mmap threshold (32 MB at most) from the kernel and unmaps it
when it is freed, so every step's activations, logits and gradients arrive as
fresh pages: the kernel zeroes each one on first touch. On the 110m preset's
full fine-tune of 4 x 1,024 tokens that is about a million page faults a
step (``benchmarks/train_step.py``'s "faults/step" column; in one 10 s window
of those rows, 32% of the machine's CPU time was the kernel's). "reuse" tells
malloc, once, before the engine's threads start: no mmap for large blocks, trim
the heap only past 2 GB free at its top, and one arena, so the engine's thread
allocates from the same heap as the rest (a thread's own arena would mmap
blocks over 64 MB anyway). Freed memory then stays in the process and the next
step takes it back without faults. The price: the process's resident size
stays at the high-water mark of its largest step instead of shrinking between
steps, and its peak moves by a few percent (110m full 4 x 1,024, the engine
in-process: 5,817 -> 6,073 MB, 0.69x -> 0.71x of plain torch's). PyTorch's
performance tuning guide suggests preloading jemalloc or tcmalloc for the same
reason; this needs neither.

Only glibc has these knobs (``mallopt``); elsewhere (musl, macOS) "reuse" does
nothing, and an engine on a GPU leaves malloc alone (its tensors are not in it).
The process-wide setting is the engine's process's: an embedded server
in a notebook sets it for the notebook's process too (``host_allocator="system"``
to leave it alone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("treadle.workers")

ALLOCATORS = ("reuse", "system")

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
#: the most mallopt's int takes: the heap is trimmed only past 2 GB free at its top
_TRIM_AT = 2**31 - 1

_lock = threading.Lock()
_done: str | None = None


def configure(allocator: str) -> bool:
    """Apply ``allocator`` to this process (once; later calls with the same value
    do nothing). True when malloc took the "reuse" settings."""
    global _done
    if allocator not in ALLOCATORS:
        raise ValueError(f"host_allocator: {allocator!r}; choose from {ALLOCATORS}")
    with _lock:
        if _done is not None:
            if _done != allocator:
                log.info(
                    "host allocator: this process already uses %r; %r ignored", _done, allocator
                )
            return _done == "reuse"
        _done = allocator
        if allocator == "system":
            return False
        mallopt = _mallopt()
        if mallopt is None:
            log.info("host allocator: not glibc; malloc keeps its defaults")
            return False
        ok = all(
            mallopt(param, value) == 1
            for param, value in (
                (_M_ARENA_MAX, 1),
                (_M_MMAP_MAX, 0),
                (_M_TRIM_THRESHOLD, _TRIM_AT),
            )
        )
        if not ok:
            log.warning("host allocator: mallopt refused a setting; malloc may free to the kernel")
        return ok


def _mallopt() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        gnu = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return None
    gnu.restype = ctypes.c_char_p
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]
