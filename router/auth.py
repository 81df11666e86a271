"""`--api-key`: a Bearer token checked in constant time.

Open without a key: `/health`, `/liveness`, `/readiness`, `/metrics` (probes and scrapers).
Everything else needs `Authorization: Bearer <key>` when `--api-key` is set. Without
`--api-key`, worker administration (`POST`/`DELETE /workers`) is refused with 403 rather than
left open to anyone who can reach the port.
"""

from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def is_authorized(api_key: str | None, authorization: str | None) -> bool:
    if api_key is None:
        return True
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())
