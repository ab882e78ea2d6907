"""The tinker SDK's session search (``RestClient.search_sessions``) <-> treadle's
``SessionQuery`` / ``SessionPage``, and the metadata a session is created with.

A treadle key is a tenant: "own" and "accessible" both mean the tenant's own
sessions (no other tenant's are ever visible), and treadle has no projects or
per-user owners, so naming either is a 400 that says so.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from treadle.errors import InvalidArgumentError
from treadle.server.http import wire
from treadle.server.service.types import FINISH_REASONS, SessionPage, SessionQuery, SessionSummary


def user_metadata(body: Mapping[str, Any]) -> dict[str, str] | None:
    """``create_session``'s ``user_metadata`` as strings (a value that is not one is
    kept as its JSON text), so a search's string pairs can match it."""
    raw = wire.field(body, "user_metadata", dict, None)
    if not raw:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}


def query(body: Mapping[str, Any]) -> SessionQuery:
    if wire.field(body, "project_ids", list, None):
        raise InvalidArgumentError("project_ids: treadle has no projects; omit them")
    owner = wire.field(body, "owner", dict, {"type": "own"})
    if owner.get("type") not in ("own", "accessible"):
        raise InvalidArgumentError(
            f"owner.type: {owner.get('type')!r}; a treadle key sees its own tenant's "
            "sessions: 'own' or 'accessible'"
        )
    metadata = wire.field(body, "user_metadata", dict, {})
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise InvalidArgumentError(f"user_metadata.{key}: expected str")
    name = wire.field(body, "display_name", str, None)
    if name is not None and not name.strip():
        raise InvalidArgumentError("display_name: empty")
    cursor = wire.field(body, "cursor", dict, None)
    return SessionQuery(
        session_id=wire.field(body, "session_id", str, None),
        display_name=name,
        user_metadata=tuple(sorted(metadata.items())),
        statuses=_statuses(wire.field(body, "statuses", list, None)),
        limit=wire.field(body, "limit", int, 50),
        after=_cursor(cursor) if cursor is not None else None,
    )


def _statuses(items: list[Any] | None) -> frozenset[str] | None:
    if items is None:
        return None
    if not items:
        raise InvalidArgumentError("statuses: empty; omit it to match every status")
    out: set[str] = set()
    for i, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "active":
            out.add("active")
        elif kind == "client_finished":
            reasons = item.get("reasons") or list(FINISH_REASONS)
            if not isinstance(reasons, list):
                raise InvalidArgumentError(f"statuses[{i}].reasons: expected a list")
            bad = [r for r in reasons if r not in FINISH_REASONS]
            if bad:
                raise InvalidArgumentError(
                    f"statuses[{i}].reasons: {bad[0]!r}; one of {', '.join(FINISH_REASONS)}"
                )
            out.update(reasons)
        elif kind not in ("cancelled", "failed"):  # states no treadle session is in
            raise InvalidArgumentError(
                f"statuses[{i}].type: {kind!r}; active, client_finished, cancelled or failed"
            )
    return frozenset(out)


def _cursor(cursor: Mapping[str, Any]) -> tuple[dt.datetime, str]:
    at = wire.field(cursor, "last_created_at", str)
    try:
        when = dt.datetime.fromisoformat(at)
    except ValueError as err:
        raise InvalidArgumentError(f"cursor.last_created_at: {at!r} is not a time") from err
    if when.tzinfo is None:
        raise InvalidArgumentError("cursor.last_created_at: needs a time zone")
    return when.astimezone(dt.timezone.utc), wire.field(cursor, "last_session_id", str)


def page(result: SessionPage, tenant_id: str) -> dict[str, Any]:
    after = result.next_after
    return {
        "sessions": [_summary(s, tenant_id) for s in result.sessions],
        "next_cursor": (
            {"last_created_at": _iso(after[0]), "last_session_id": after[1]} if after else None
        ),
    }


def _summary(s: SessionSummary, tenant_id: str) -> dict[str, Any]:
    if s.active:
        status: dict[str, Any] | None = {"type": "active"}
    elif s.finish_reason is not None:
        status = {
            "type": "client_finished",
            "reason": {"type": s.finish_reason},
            "detail": s.finish_detail,
        }
    else:  # ended without the client's word (its heartbeats lapsed, or a gRPC client)
        status = None
    return {
        "session_id": s.session_id,
        "created_at": _iso(s.created_at),
        "owner": tenant_id,
        "project_id": "",
        "status": status,
        "checkpoints_count": s.checkpoints,
        "display_name": s.display_name,
        "user_metadata": s.user_metadata,
        "checkpoint_storage_bytes": s.checkpoint_bytes,
    }


def _iso(when: dt.datetime) -> str:
    aware = when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)
    return aware.astimezone(dt.timezone.utc).isoformat()
