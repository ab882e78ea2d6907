"""The console's sign-in: an API key, given once in a form, becomes a signed
session cookie (HttpOnly, SameSite=Strict, Secure over TLS) that names the key
by its id, never its value; every page checks the key is still live, so a
revoked key signs its sessions out. Mutating forms carry a CSRF token derived
from the session.

The signing secret lives in ``DATA_DIR/console_secret`` (mode 0600, made on the
first start): sessions survive a restart; servers sharing a data directory (or
the file) share sessions. Deleting the file signs everyone out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from treadle.server.auth import write_key_file

COOKIE = "treadle_console"
SECRET_FILE = "console_secret"
#: how long a sign-in lasts
SESSION_S = 12 * 3600


@dataclass(frozen=True)
class ConsoleSession:
    tenant_id: str
    key_id: str  # "" with auth off
    expires: int  # unix seconds
    nonce: str

    @property
    def cookie_max_age(self) -> int:
        return max(0, self.expires - int(time.time()))


def load_secret(data_dir: Path) -> bytes:
    path = data_dir / SECRET_FILE
    if path.exists():
        text = path.read_text().strip()
        if len(text) >= 32:
            return text.encode()
    text = secrets.token_urlsafe(32)
    write_key_file(path, text)
    return text.encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class CookieSigner:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, purpose: str, data: bytes) -> bytes:
        return hmac.new(self._secret, purpose.encode() + b"|" + data, hashlib.sha256).digest()

    def issue(
        self, tenant_id: str, key_id: str, now: float | None = None
    ) -> tuple[str, ConsoleSession]:
        now = time.time() if now is None else now
        session = ConsoleSession(tenant_id, key_id, int(now) + SESSION_S, secrets.token_hex(16))
        body = json.dumps(
            {"t": tenant_id, "k": key_id, "e": session.expires, "n": session.nonce},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(body)}.{_b64(self._mac('session', body))}", session

    def read(self, cookie: str | None, now: float | None = None) -> ConsoleSession | None:
        """The session a cookie carries; None for a missing, malformed, forged or
        expired one (all alike to the caller: sign in again)."""
        if not cookie or len(cookie) > 1024 or cookie.count(".") != 1:
            return None
        body_b64, mac_b64 = cookie.split(".")
        try:
            body, mac = _unb64(body_b64), _unb64(mac_b64)
        except (ValueError, TypeError):
            return None
        if not hmac.compare_digest(mac, self._mac("session", body)):
            return None
        try:
            data = json.loads(body)
            session = ConsoleSession(str(data["t"]), str(data["k"]), int(data["e"]), str(data["n"]))
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires <= (time.time() if now is None else now):
            return None
        return session

    def csrf(self, session: ConsoleSession) -> str:
        return _b64(self._mac("csrf", session.nonce.encode()))

    def check_csrf(self, session: ConsoleSession, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(str(token), self.csrf(session))
