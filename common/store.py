"""Checkpoint storage and ``treadle://`` names.

Names: ``treadle://<model_id>/state/<name>`` for saved training state and
``treadle://<model_id>/v/<version>`` (or ``/latest``) for published weights.
A name is resolved per tenant through the database, so another tenant's path
answers NOT_FOUND like a path that does not exist.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from treadle.errors import InvalidArgumentError

SCHEME = "treadle://"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class WeightsRef:
    model_id: str
    version: int | None  # None = latest


def state_uri(model_id: str, name: str) -> str:
    return f"{SCHEME}{model_id}/state/{name}"


def weights_uri(model_id: str, version: int) -> str:
    return f"{SCHEME}{model_id}/v/{version}"


def check_name(name: str, field: str = "name") -> str:
    if not _NAME.match(name):
        raise InvalidArgumentError(
            f"{field}: {name!r} must be 1-128 characters of letters, digits, '.', '_', '-' (not starting with . _ -)"
        )
    return name


def parse_state_uri(uri: str, field: str = "path") -> tuple[str, str]:
    parts = uri[len(SCHEME) :].split("/") if uri.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] != "state" or not parts[0]:
        raise InvalidArgumentError(
            f"{field}: {uri!r} is not a treadle://<model_id>/state/<name> path"
        )
    return parts[0], check_name(parts[2], field)


def parse_weights_uri(uri: str, field: str = "weights") -> WeightsRef:
    parts = uri[len(SCHEME) :].split("/") if uri.startswith(SCHEME) else []
    if len(parts) == 2 and parts[1] == "latest" and parts[0]:
        return WeightsRef(parts[0], None)
    if len(parts) == 3 and parts[1] == "v" and parts[0] and parts[2].isdigit():
        return WeightsRef(parts[0], int(parts[2]))
    raise InvalidArgumentError(
        f"{field}: {uri!r} is not a treadle://<model_id>/v/<version> or treadle://<model_id>/latest path"
    )


class Store(Protocol):
    """Where checkpoints live. A checkpoint is a directory (``treadle.workers.trainer.checkpoint``);
    its *storage path* (what the DB row records) is a local directory for
    ``LocalStore`` and an ``s3://bucket/key`` prefix for ``S3Store``.

    Engines only read and write local directories: a save is written into
    ``staging_dir(path)`` and then ``commit``-ted (uploaded), a load reads
    ``fetch(path)`` (a download) and ``release``-s it afterwards. For the local
    store all four are the identity, so the embedded path copies nothing.
    """

    #: local directory the engine writes auto-checkpoints under (``<root>/<tenant>/<model>/auto``)
    local_root: Path
    #: True when storage paths are local directories every engine can read directly
    is_local: bool

    def state_path(self, tenant_id: str, model_id: str, name: str) -> str: ...
    def state_dir(self, tenant_id: str, model_id: str, name: str) -> Path:
        """``state_path`` as a ``Path`` (older callers); prefer ``state_path``."""
        ...

    def staging_dir(self, storage_path: str) -> Path: ...
    def commit(self, local_dir: Path, storage_path: str) -> int: ...
    def fetch(self, storage_path: str) -> Path: ...
    def release(self, local_dir: Path, storage_path: str) -> None: ...
    def read_manifest(self, storage_path: str) -> dict[str, Any]: ...
    def delete(self, storage_path: str) -> None: ...


class LocalStore:
    """Checkpoints as directories under ``root/<tenant>/<model_id>/<name>`` (a shared
    filesystem when workers run on other hosts)."""

    is_local = True

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.local_root = self.root

    def state_dir(self, tenant_id: str, model_id: str, name: str) -> Path:
        path = self.root / tenant_id / model_id / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def state_path(self, tenant_id: str, model_id: str, name: str) -> str:
        return str(self.state_dir(tenant_id, model_id, name))

    def staging_dir(self, storage_path: str) -> Path:
        Path(storage_path).parent.mkdir(parents=True, exist_ok=True)
        return Path(storage_path)

    def commit(self, local_dir: Path, storage_path: str) -> int:
        return sum(f.stat().st_size for f in Path(storage_path).iterdir())

    def fetch(self, storage_path: str) -> Path:
        return Path(storage_path)

    def release(self, local_dir: Path, storage_path: str) -> None:
        pass

    def read_manifest(self, storage_path: str) -> dict[str, Any]:
        from treadle.common.manifest import read_manifest

        return read_manifest(storage_path)

    def delete(self, storage_path: str) -> None:
        shutil.rmtree(storage_path, ignore_errors=True)


#: the file of a checkpoint that holds the Adam moments; a weights-only copy leaves it out
OPTIMIZER_FILE = "optimizer.safetensors"


def copy_checkpoint(
    store: Store, src_path: str, dst_path: str, *, weights_only: bool = False
) -> int:
    """Copy a checkpoint to another storage path of the same store; the bytes written.
    ``weights_only`` leaves the optimizer state out (a model loaded from the copy
    starts with fresh Adam moments). Blocking I/O: call it off the event loop."""
    src = store.fetch(src_path)
    staging = store.staging_dir(dst_path)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(src, staging)
        if weights_only:
            (staging / OPTIMIZER_FILE).unlink(missing_ok=True)
        return store.commit(staging, dst_path)
    finally:
        store.release(src, src_path)
        store.release(staging, dst_path)


def storage_path_str(path: str | Path) -> str:
    """A storage path as the store wrote it. ``Path("s3://b/k")`` reads ``s3:/b/k``
    (pathlib folds the double slash), so a path that went through ``Path`` is mended."""
    text = str(path)
    if text.startswith("s3:/") and not text.startswith("s3://"):
        text = "s3://" + text[len("s3:/") :]
    return text


def make_store(url: str, *, local_root: Path, endpoint_url: str = "", staging: Path) -> Store:
    """``""`` or a directory -> ``LocalStore``; ``s3://bucket/prefix`` -> ``S3Store``
    (checkpoints staged under ``staging`` on their way to and from the bucket)."""
    if url.startswith("s3://"):
        from treadle.common.s3_store import S3Store

        return S3Store(url, endpoint_url=endpoint_url or None, staging=staging)
    return LocalStore(Path(url) if url else local_root)
