"""Who is calling over HTTP: the ``X-API-Key`` header, one FastAPI dependency.

The tinker SDK refuses keys that do not start with ``tml-``, so a treadle key
travels as ``tml-`` + the key (``tml-tdl-...``); the rest is the gRPC path's
``Authenticator`` (same cache, same revocation, same tenant). Every route but
the open ones (health, client config) takes the tenant from here.
"""

from __future__ import annotations

from starlette.requests import Request

from treadle.errors import UnauthenticatedError

TINKER_PREFIX = "tml-"


def treadle_key(header: str | None) -> str | None:
    """The treadle key inside an ``X-API-Key`` value (``tml-tdl-...`` -> ``tdl-...``)."""
    if not header:
        return None
    key = header.strip()
    if key.startswith(TINKER_PREFIX):
        key = key[len(TINKER_PREFIX) :]
    return key or None


def tinker_key(key: str) -> str:
    """The form of a treadle key the tinker SDK accepts."""
    return key if key.startswith(TINKER_PREFIX) else TINKER_PREFIX + key


async def tenant(request: Request) -> str:
    """The caller's tenant (401 for a missing or unknown key)."""
    auth = request.app.state.ctx.auth
    key = treadle_key(request.headers.get("x-api-key"))
    if key is None and auth.enabled:
        raise UnauthenticatedError(
            "no API key: send 'X-API-Key: tml-<treadle key>' (the tinker SDK sends "
            "TINKER_API_KEY; a treadle key tdl-... is used as tml-tdl-...)"
        )
    return str(auth.authenticate([("authorization", f"Bearer {key}")] if key else []))
