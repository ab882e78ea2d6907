"""The device's memory as the operator sees it (``EngineReport.memory``).

On a GPU: what torch's caching allocator has reserved in this process, and the
device's free and total memory (``cuda.mem_get_info``: other processes count).
On the CPU: this process's resident set, and the host's ``MemAvailable`` and
``MemTotal`` (Linux; 0 where unknown). Cheap enough for every heartbeat.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treadle.common.engine.report import MemoryReading


def read(where: torch.device) -> MemoryReading:
    if where.type == "cuda":
        free, total = torch.cuda.mem_get_info(where)
        return MemoryReading(int(torch.cuda.memory_reserved(where)), int(free), int(total))
    meminfo = _kib_fields(Path("/proc/meminfo"))
    status = _kib_fields(Path("/proc/self/status"))
    return MemoryReading(
        used_bytes=status.get("VmRSS", 0),
        free_bytes=meminfo.get("MemAvailable", 0),
        total_bytes=meminfo.get("MemTotal", 0),
    )


def _kib_fields(path: Path) -> dict[str, int]:
    """``Name: N kB`` lines of a /proc file, in bytes."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out
