"""``treadle admin``: tenants, API keys, quotas and usage, straight on the database.

It needs no running server: it opens the same database ``treadle serve`` uses
(``--database-url``, or the SQLite file in ``--data-dir``) and brings its schema
up to date first. A new key is printed once, alone on stdout (so a script can
capture it); everything else a human reads goes to stderr. The server sees a
revoked key within its ``--auth-cache-s``, and quota changes within 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from sqlalchemy.orm import Session

from treadle.common.db import models as db
from treadle.common.engine.report import EngineReport
from treadle.errors import AlreadyExistsError, InvalidArgumentError
from treadle.server.auth import generate_key, hash_key, key_prefix
from treadle.server.db import make_engine, make_session_factory, queries, tenancy, upgrade_to_head


def add_admin_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    admin = sub.add_parser("admin", help="tenants, API keys, quotas and usage")
    admin.add_argument("--data-dir", default=os.environ.get("TREADLE_DATA_DIR", "treadle-data"))
    admin.add_argument(
        "--database-url",
        default=os.environ.get("TREADLE_DATABASE_URL", ""),
        help="default: SQLite in the data dir; PostgreSQL: postgresql+psycopg://...",
    )
    cmds = admin.add_subparsers(dest="admin_command", required=True)

    p = cmds.add_parser("create-tenant", help="a new tenant and its first key (printed)")
    p.add_argument("name")
    p.set_defaults(fn=_create_tenant)

    p = cmds.add_parser("create-key", help="another key for a tenant (printed)")
    p.add_argument("tenant", help="name or id")
    p.set_defaults(fn=_create_key)

    p = cmds.add_parser("revoke-key", help="revoke a key by its id (see list-keys)")
    p.add_argument("key_id")
    p.set_defaults(fn=_revoke_key)

    p = cmds.add_parser("list-keys", help="keys (id, prefix, state), never the keys")
    p.add_argument("tenant", nargs="?", help="name or id (default: all)")
    p.set_defaults(fn=_list_keys)

    p = cmds.add_parser("list-tenants", help="tenants and their quota overrides")
    p.set_defaults(fn=_list_tenants)

    p = cmds.add_parser(
        "set-quota", help="override a tenant's quotas ('default' = the server's default)"
    )
    p.add_argument("tenant", help="name or id")
    for name in tenancy.QUOTA_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar="N|default")
    p.set_defaults(fn=_set_quota)

    p = cmds.add_parser(
        "list-workers", help="workers of a distributed server: role, status, base models, load"
    )
    p.set_defaults(fn=_list_workers)

    p = cmds.add_parser("usage", help="tokens, calls, compute seconds, checkpoints per model")
    p.add_argument("tenant", nargs="?", help="name or id (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(fn=_usage)


@contextmanager
def _session(args: argparse.Namespace) -> Iterator[Session]:
    url = args.database_url or f"sqlite:///{(Path(args.data_dir) / 'treadle.db').resolve()}"
    if not args.database_url:
        Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    engine = make_engine(url)  # a malformed URL: InvalidArgumentError naming database_url
    try:
        upgrade_to_head(engine)
        with make_session_factory(engine)() as s:
            yield s
            s.commit()
    finally:
        engine.dispose()


def _new_key(s: Session, tenant_id: str) -> tuple[str, str]:
    key = generate_key()
    row = queries.create_api_key(s, tenant_id, hash_key(key), key_prefix(key))
    return row.id, key


def _create_tenant(args: argparse.Namespace) -> int:
    name = args.name.strip()
    if not name or len(name) > 255:
        raise InvalidArgumentError("name: 1-255 characters")
    with _session(args) as s:
        if tenancy.get_tenant_by_name(s, name) is not None:
            raise AlreadyExistsError(f"tenant {name!r} already exists (create-key adds a key)")
        tenant = queries.ensure_tenant(s, name)
        key_id, key = _new_key(s, tenant.id)
    print(f"tenant {name} ({tenant.id}); key {key_id}:", file=sys.stderr)
    print(key)
    return 0


def _create_key(args: argparse.Namespace) -> int:
    with _session(args) as s:
        tenant = tenancy.find_tenant(s, args.tenant)
        key_id, key = _new_key(s, tenant.id)
        name = tenant.name
    print(f"key {key_id} for tenant {name}:", file=sys.stderr)
    print(key)
    return 0


def _revoke_key(args: argparse.Namespace) -> int:
    with _session(args) as s:
        key = tenancy.revoke_key(s, args.key_id)
        print(f"revoked {key.id} ({key.prefix}...) at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    return 0


def _list_keys(args: argparse.Namespace) -> int:
    with _session(args) as s:
        tenant_id = tenancy.find_tenant(s, args.tenant).id if args.tenant else None
        names = {t.id: t.name for t in tenancy.list_tenants(s)}
        rows = [
            (
                k.id,
                names.get(k.tenant_id, k.tenant_id),
                k.prefix + "...",
                f"{k.created_at:%Y-%m-%d %H:%M}",
                "revoked" if k.revoked_at else "live",
            )
            for k in tenancy.list_keys(s, tenant_id)
        ]
    _table(("key id", "tenant", "prefix", "created (UTC)", "state"), rows)
    return 0


def _list_tenants(args: argparse.Namespace) -> int:
    with _session(args) as s:
        rows = [
            (
                t.name,
                t.id,
                *(
                    "default" if getattr(t, f) is None else str(getattr(t, f))
                    for f in tenancy.QUOTA_FIELDS
                ),
            )
            for t in tenancy.list_tenants(s)
        ]
    _table(("tenant", "id", *tenancy.QUOTA_FIELDS), rows)
    return 0


def _list_workers(args: argparse.Namespace) -> int:
    """Every ``treadle worker`` the database knows, its role (``--role``) and its models."""
    from sqlalchemy import select

    from treadle.common.db import workers as wq

    with _session(args) as s:
        loads = wq.worker_loads(s)
        rows = []
        for w in s.scalars(select(db.Worker).order_by(db.Worker.id)):
            report = wq.report_of(w) if w.status == "live" else None
            rows.append(
                (
                    w.id,
                    w.role,
                    w.status,
                    ",".join(wq.base_models_of(w)),
                    f"{loads.get(w.id, 0)}/{w.capacity}",
                    *(_reported(report) if report is not None else ("-", "-", "-", "-")),
                    w.heartbeat_at.strftime("%Y-%m-%d %H:%M:%S"),
                )
            )
    head = ("worker", "role", "status", "base models", "models")
    _table((*head, "device", "memory", "adapters", "waiting", "last heartbeat"), rows)
    return 0


def _reported(report: EngineReport) -> tuple[str, str, str, str]:
    """The last heartbeat's device, memory held / total, adapters and waiting calls."""
    m = report.memory
    memory = f"{m.used_bytes / 2**30:.2f}/{m.total_bytes / 2**30:.1f} GiB"
    waiting = sum(q.waiting for q in report.queue)
    return report.device, memory, str(report.adapters), str(waiting)


def _set_quota(args: argparse.Namespace) -> int:
    changes: dict[str, int | None] = {}
    for name in tenancy.QUOTA_FIELDS:
        value = getattr(args, name)
        if value is None:
            continue
        if value == "default":
            changes[name] = None
        elif value.isdigit():
            changes[name] = int(value)
        else:
            raise InvalidArgumentError(f"{name}: {value!r} is not a count >= 0 or 'default'")
    if not changes:
        raise InvalidArgumentError(
            "set-quota: give at least one of --"
            + ", --".join(f.replace("_", "-") for f in tenancy.QUOTA_FIELDS)
        )
    with _session(args) as s:
        tenant = tenancy.set_quota(s, tenancy.find_tenant(s, args.tenant), **changes)
        shown = {f: getattr(tenant, f) for f in tenancy.QUOTA_FIELDS}
    print(f"tenant {tenant.name}: " + ", ".join(f"{k}={v or 'default'}" for k, v in shown.items()))
    return 0


def _usage(args: argparse.Namespace) -> int:
    with _session(args) as s:
        tenant_id = tenancy.find_tenant(s, args.tenant).id if args.tenant else None
        lines = tenancy.usage_report(s, tenant_id)
    if args.json:
        for line in lines:
            print(json.dumps(asdict(line)))
        return 0
    rows = [
        (
            u.tenant,
            u.model_id or "(base)",
            u.base_model,
            f"{u.tokens_sampled:,}",
            f"{u.tokens_trained:,}",
            f"{u.tokens_scored:,}",
            f"{u.calls:,}",
            f"{u.compute_s:.2f}",
            str(u.checkpoints),
            _size(u.checkpoint_bytes),
        )
        for u in lines
    ]
    _table(
        (
            "tenant",
            "model",
            "base",
            "sampled",
            "trained",
            "scored",
            "calls",
            "compute s",
            "ckpts",
            "stored",
        ),
        rows,
    )
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table(header: tuple[str, ...], rows: Sequence[tuple[object, ...]]) -> None:
    if not rows:
        print("(none)")
        return
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
