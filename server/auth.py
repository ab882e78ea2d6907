"""Who is calling: API keys, the tenant behind each request, and the interceptor
that makes every RPC answer that question before it runs.

A key is ``tdl-`` + 32 random bytes (urlsafe base64, 256 bits); the database
keeps only its sha256 and a short prefix for humans. The SDK sends it as
``authorization: Bearer <key>``. ``AuthInterceptor`` authenticates every method
except health checking and reflection (an allow-list, so a service added later
is closed until someone opens it) and hands the tenant to the servicer through a
context variable; ``ServerContext.tenant()`` reads it and fails closed.

Lookups are cached for ``cache_s`` seconds, so a revoked key stops working
within that time (0 = ask the database on every call). With auth off (``--no-auth``,
loopback only) every caller is the ``default`` tenant, as before keys existed.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from sqlalchemy.orm import Session, sessionmaker

from treadle.errors import InvalidArgumentError, UnauthenticatedError
from treadle.server.call_record import note_tenant
from treadle.server.db import queries, tenancy
from treadle.server.rpc.interceptor_base import WrappingInterceptor

log = logging.getLogger("treadle.server")

DEFAULT_TENANT = "default"
KEY_PREFIX = "tdl-"
KEY_FILE = "api_key"
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{22,}$")  # >= 22 base64 chars = >= 128 bits

#: RPCs anyone may call: liveness and service discovery carry no tenant data
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "treadle_tenant", default=None
)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_key(key: str, field: str = "api_key") -> str:
    """A key we would have made: the prefix and at least 128 random bits."""
    if not key.startswith(KEY_PREFIX) or not _KEY_RE.match(key[len(KEY_PREFIX) :]):
        raise InvalidArgumentError(
            f"{field}: not a treadle API key (expected {KEY_PREFIX} and at least 22 "
            "urlsafe base64 characters; make one with `treadle admin create-key`)"
        )
    return key


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str:
    """What an operator sees of a key in listings: never enough to use it."""
    return key[:12]


def bearer_key(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for name, value in metadata or ():
        if name == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def current_tenant() -> str:
    """The tenant of the RPC being served (set by ``AuthInterceptor``)."""
    tenant = _current_tenant.get()
    if tenant is None:  # a handler reached without the interceptor: refuse, never guess
        raise UnauthenticatedError("the request was not authenticated")
    return tenant


class Authenticator:
    def __init__(
        self,
        sessions: sessionmaker[Session] | None,
        default_tenant_id: str,
        *,
        enabled: bool = True,
        cache_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if enabled and sessions is None:
            raise ValueError("an enabled Authenticator needs database sessions")
        self.sessions = sessions
        self.default_tenant_id = default_tenant_id
        self.enabled = enabled
        self.cache_s = cache_s
        self._clock = clock
        self._cache: dict[str, tuple[str, float]] = {}  # key hash -> (tenant id, expiry)

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant id, or UNAUTHENTICATED."""
        if not self.enabled:
            return self.default_tenant_id
        key = bearer_key(metadata)
        if key is None:
            raise UnauthenticatedError(
                "no API key: send 'authorization: Bearer <key>' "
                "(ServiceClient(api_key=...) or env TREADLE_API_KEY; `treadle serve` writes "
                "its default tenant's key to DATA_DIR/api_key, which the Python SDK reads "
                "by itself for a server on this machine when run from beside treadle-data/)"
            )
        digest = hash_key(key)
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        assert self.sessions is not None
        with self.sessions() as s:
            tenant = queries.find_tenant_by_key_hash(s, digest)
            tenant_id = tenant.id if tenant is not None else None
        if tenant_id is None:
            self._cache.pop(digest, None)
            raise UnauthenticatedError("the API key is not valid (unknown or revoked)")
        if self.cache_s > 0:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (tenant_id, now + self.cache_s)
        return tenant_id

    # kept for callers of the earlier seam
    def tenant_for(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        return self.authenticate(metadata)


class AuthInterceptor(WrappingInterceptor):
    """Authenticates every RPC but the open ones, before the handler runs.

    Listed after ``ErrorInterceptor``, so UNAUTHENTICATED is answered by the one
    place that maps errors to status codes.
    """

    open_prefixes = OPEN_METHOD_PREFIXES
    client_streams = True

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def wrap_unary(
        self, behavior: Callable[..., Any], method: str
    ) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = _current_tenant.set(self.auth.authenticate(context.invocation_metadata()))
            note_tenant(_current_tenant.get() or "")
            try:
                return await behavior(request, context)
            finally:
                _current_tenant.reset(token)

        return wrapped

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            token = _current_tenant.set(self.auth.authenticate(context.invocation_metadata()))
            note_tenant(_current_tenant.get() or "")
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                _current_tenant.reset(token)

        return wrapped


# --- the default tenant's key (embedded server) ---------------------------------


@dataclass(frozen=True)
class DefaultKey:
    tenant_id: str
    key: str | None  # None: the key file is absent or no longer valid
    path: Path
    created: bool


def bootstrap_default_tenant(
    sessions: sessionmaker[Session], data_dir: Path, *, auth: bool, preset_key: str = ""
) -> DefaultKey:
    """Make the ``default`` tenant, and on its first start its key, written to
    ``<data_dir>/api_key`` (mode 0600). A tenant that was ever given a key gets no
    new one (revoking it stays revoked); the file is read back when still valid.
    ``preset_key`` is used instead of a random key (an embedded server whose
    client already holds one)."""
    path = data_dir / KEY_FILE
    with sessions() as s:
        tenant = queries.ensure_tenant(s, DEFAULT_TENANT)
        s.commit()
        if not auth:
            return DefaultKey(tenant.id, None, path, False)
        if not tenancy.has_any_key(s, tenant.id):
            key = check_key(preset_key, "bootstrap_api_key") if preset_key else generate_key()
            queries.create_api_key(s, tenant.id, hash_key(key), key_prefix(key))
            s.commit()
            write_key_file(path, key)
            log.warning(
                "created an API key for tenant %r, stored in %s (export TREADLE_API_KEY=...)",
                DEFAULT_TENANT,
                path.resolve(),
            )
            return DefaultKey(tenant.id, key, path, True)
        key = path.read_text().strip() if path.exists() else ""
        if key and tenancy.is_live_key(s, hash_key(key)):
            return DefaultKey(tenant.id, key, path, False)
        return DefaultKey(tenant.id, None, path, False)


def write_key_file(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
