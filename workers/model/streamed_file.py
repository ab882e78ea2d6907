"""A safetensors file written one tensor at a time.

``safetensors.torch.save_file`` takes every tensor at once, so writing a model
sharded over a group of ranks (a checkpoint, a merged export) would hold the
whole model on rank 0. The format needs no such thing: an 8-byte header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes.
With the names, dtypes and shapes known first (a sharded parameter knows its
global shape), the header is written first and each tensor's bytes as it comes:
gathered, written, dropped. Any safetensors reader reads the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

#: safetensors' dtype names
_DTYPES: Mapping[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file, as the header declares it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(name: str, t: Tensor) -> Entry:
        """The entry of ``t`` (a sharded parameter's global shape, not its shard's)."""
        return Entry(name, t.dtype, tuple(t.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def write(
    path: str | Path,
    entries: Sequence[Entry],
    tensors: Iterable[tuple[str, Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``entries``' header, then each tensor ``tensors`` yields, in ``entries``'
    order (each checked against its entry, copied to the host if it is not there,
    written and let go)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    at = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise TypeError(f"{e.name}: dtype {e.dtype} has no safetensors name")
        header[e.name] = {
            "dtype": _DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as save_file's
    out = Path(path)
    with out.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        count = 0
        for name, t in tensors:  # not zip: its reused result would hold the last tensor
            if count == len(entries):
                raise ValueError(f"{name} comes after the {count} tensors of the header")
            e = entries[count]
            if name != e.name or t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise ValueError(
                    f"{name} {t.dtype} {tuple(t.shape)} comes where the header has "
                    f"{e.name} {e.dtype} {e.shape}"
                )
            host = t.detach().to("cpu").contiguous()
            f.write(host.reshape(-1).view(torch.uint8).numpy().data)
            count += 1
            del t, host  # let go before the next is asked for (on a group: gathered)
        if count != len(entries):
            raise ValueError(f"{count} tensors written, the header has {len(entries)}")
    return out
