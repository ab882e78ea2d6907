"""tinker ids and paths <-> treadle's, per tenant.

- Model ids: treadle's own; a model made by ``load_weights`` from a session is
  also known by the id the SDK derives for it, ``<session_id>:train:<n>``.
- ``tinker://<model_id>/weights/<name>`` is the tenant's checkpoint
  ``treadle://<model_id>/state/<name>`` (weights and optimizer state).
- ``tinker://<model_id>/sampler_weights/<name>`` is a published weight version,
  ``treadle://<model_id>/v/<n>``.

Both tables are kept in the database (``tinker_names``) and cached here, so a
server restart still resolves the names it gave out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from sqlalchemy.orm import Session

from treadle.common.store import check_name, state_uri, weights_uri
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.db import queries

SCHEME = "tinker://"
TREADLE = "treadle://"
MODEL = "model"
SAMPLER_WEIGHTS = "sampler_weights"

SessionFactory = Callable[[], AbstractContextManager[Session]]


class Names:
    def __init__(self, session: SessionFactory | None = None) -> None:
        self._session = session
        self._aliases: dict[tuple[str, str], str] = {}  # (tenant, sdk id) -> model id
        self._sampler_weights: dict[tuple[str, str, str], int] = {}
        #: (tenant, model id) -> (name, unix time) of its last named sampler save
        self._last_sampler: dict[tuple[str, str], tuple[str, float]] = {}

    def _put(self, tenant: str, kind: str, key: str, model_id: str, version: int | None) -> None:
        if self._session is not None:
            with self._session() as s:
                queries.put_tinker_name(s, tenant, kind, key, model_id, version)

    def _get(self, tenant: str, kind: str, key: str) -> tuple[str, int | None] | None:
        if self._session is None:
            return None
        with self._session() as s:
            row = queries.get_tinker_name(s, tenant, kind, key)
            return None if row is None else (row.model_id, row.version)

    # ---- model ids
    def alias(self, tenant: str, sdk_id: str, model_id: str) -> None:
        self._put(tenant, MODEL, sdk_id, model_id, None)
        self._aliases[(tenant, sdk_id)] = model_id

    def model_id(self, tenant: str, value: object, field: str = "model_id") -> str:
        if not isinstance(value, str) or not value:
            raise InvalidArgumentError(f"{field}: required (a string)")
        known = self._aliases.get((tenant, value))
        if known is None and ":train:" in value:
            stored = self._get(tenant, MODEL, value)
            if stored is not None:
                known = self._aliases[(tenant, value)] = stored[0]
        return known or value

    # ---- paths
    def weights_path(self, model_id: str, name: str) -> str:
        return f"{SCHEME}{model_id}/weights/{name}"

    def sampler_path(self, tenant: str, model_id: str, name: str, version: int) -> str:
        self._put(tenant, SAMPLER_WEIGHTS, f"{model_id}/{name}", model_id, version)
        self._sampler_weights[(tenant, model_id, name)] = version
        self._last_sampler[(tenant, model_id)] = (name, time.time())
        return f"{SCHEME}{model_id}/sampler_weights/{name}"

    def last_sampler_weights(self, tenant: str, model_id: str) -> tuple[str, float] | None:
        """(name, unix time) of the model's last named ``save_weights_for_sampler``."""
        if self._session is not None:
            with self._session() as s:
                row = queries.last_tinker_name(s, tenant, SAMPLER_WEIGHTS, model_id)
                if row is not None:
                    return row.key.split("/", 1)[1], row.created_at.timestamp()
        return self._last_sampler.get((tenant, model_id))

    def split(self, tenant: str, path: object, field: str = "path") -> tuple[str, str, str]:
        """``tinker://<model_id>/<kind>/<name>`` -> (model id, kind, name)."""
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise InvalidArgumentError(
                f"{field}: {path!r} is not a tinker://<model_id>/weights/<name> path"
            )
        parts = path[len(SCHEME) :].split("/")
        if len(parts) != 3 or not parts[0] or parts[1] not in ("weights", "sampler_weights"):
            raise InvalidArgumentError(
                f"{field}: {path!r} is not tinker://<model_id>/(weights|sampler_weights)/<name>"
            )
        return self.model_id(tenant, parts[0], field), parts[1], check_name(parts[2], field)

    def state_uri(self, tenant: str, path: object, field: str = "path") -> str:
        """The treadle checkpoint a training-state path names (treadle:// accepted too)."""
        if isinstance(path, str) and path.startswith(TREADLE):
            return path
        model_id, kind, name = self.split(tenant, path, field)
        if kind != "weights":
            raise InvalidArgumentError(
                f"{field}: {path!r} holds sampler weights only; load a "
                "tinker://<model_id>/weights/<name> path (save_state / save_weights)"
            )
        return state_uri(model_id, name)

    def sampler_version(self, tenant: str, model_id: str, name: str) -> int | None:
        """The weight version ``tinker://<model_id>/sampler_weights/<name>`` names, if any."""
        version = self._sampler_weights.get((tenant, model_id, name))
        if version is None:
            stored = self._get(tenant, SAMPLER_WEIGHTS, f"{model_id}/{name}")
            if stored is not None and stored[1] is not None:
                version = self._sampler_weights[(tenant, model_id, name)] = stored[1]
        return version

    def sampler_weights_uri(self, tenant: str, path: object, field: str = "model_path") -> str:
        """The treadle weight version a sampler path names (treadle:// accepted too)."""
        if isinstance(path, str) and path.startswith(TREADLE):
            return path
        model_id, kind, name = self.split(tenant, path, field)
        if kind != "sampler_weights":
            raise InvalidArgumentError(
                f"{field}: {path!r} is a training checkpoint; sample from "
                "tinker://<model_id>/sampler_weights/<name> (save_weights_for_sampler)"
            )
        version = self.sampler_version(tenant, model_id, name)
        if version is None:
            raise NotFoundError(f"{field}: {path!r} not found")
        return weights_uri(model_id, version)

    def tinker_from_state_uri(self, uri: str) -> str:
        """treadle://<model_id>/state/<name> -> tinker://<model_id>/weights/<name>."""
        model_id, _, name = uri[len(TREADLE) :].split("/")
        return self.weights_path(model_id, name)
