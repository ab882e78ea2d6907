"""Who is calling: the tenant behind a request.

The embedded default serves one tenant, ``default``, and needs no key. API keys
and tenant walls for a shared service build on this seam.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_TENANT = "default"


class Authenticator:
    def __init__(self, default_tenant_id: str) -> None:
        self.default_tenant_id = default_tenant_id

    def tenant_for(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        return self.default_tenant_id
