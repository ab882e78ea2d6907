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


class LocalStore:
    """Checkpoints as directories under ``root/<tenant>/<model_id>/<name>``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def state_dir(self, tenant_id: str, model_id: str, name: str) -> Path:
        path = self.root / tenant_id / model_id / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def delete(self, storage_path: str) -> None:
        shutil.rmtree(storage_path, ignore_errors=True)
