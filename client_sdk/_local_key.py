"""The API key of a server on this machine, found without being told.

``treadle serve`` writes its default tenant's key to ``<data dir>/api_key``
(mode 0600; the data dir is ``--data-dir``, env ``TREADLE_DATA_DIR``, default
``./treadle-data``). So that the first script a user runs next to that server
just works, a client given no key (no ``api_key=``, no env ``TREADLE_API_KEY``)
that talks to a loopback address reads that file. Only for loopback: a key
read from this machine's disk is never sent to another host, and a remote
server still needs its key given explicitly.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

KEY_FILE = "api_key"
DEFAULT_DATA_DIR = "treadle-data"


def is_loopback(address: str) -> bool:
    """Whether a gRPC target (``host:port``, ``[::1]:port``, ``ipv4:127.0.0.1:port``)
    names this machine."""
    target = address.split("://", 1)[-1]
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if target.startswith(scheme):
            target = target[len(scheme) :].lstrip("/")
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_api_key(address: str) -> str | None:
    """The key in the local server's data dir, when ``address`` is loopback and it exists."""
    if not is_loopback(address):
        return None
    path = Path(os.environ.get("TREADLE_DATA_DIR") or DEFAULT_DATA_DIR) / KEY_FILE
    try:
        key = path.read_text().strip()
    except OSError:
        return None
    return key or None
