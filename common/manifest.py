"""The manifest of a checkpoint directory (``manifest.json``: format, base model,
LoRA rank/alpha, dtype, step, seq_id), read and checked.

Engines write checkpoints (``treadle.workers.trainer.checkpoint``); the checkpoint
stores (``treadle.common.store``, ``treadle.common.s3_store``) read a manifest
to list and copy them without loading any weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from treadle.errors import InvalidArgumentError, NotFoundError

FORMAT = "treadle-state-v1"


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / "manifest.json"
    if not path.exists():
        raise NotFoundError(f"path: no checkpoint at {directory}")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise InvalidArgumentError(
            f"path: unsupported checkpoint format {manifest.get('format')!r}"
        )
    return manifest
