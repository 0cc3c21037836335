"""Who calls the E2B API.

The control API takes E2B's ``X-API-KEY`` header (or ``Authorization: Bearer``): its value is a dsec
token, the operator's or a tenant's, so an E2B API key *is* a dsec tenant token.

The in-sandbox (envd) API is reached with a per-sandbox access token, E2B's ``envdAccessToken``: the
create answer carries it and the SDK sends it as ``X-Access-Token`` with every call, next to the
``E2b-Sandbox-Id`` header that routes the call. The token is an HMAC of the sandbox id under a key
only the daemon holds (``STATE_DIR/e2b.key``, 0600), so it needs no table, survives a daemon restart,
and opens exactly one sandbox. A signed file URL (E2B's ``signature`` query parameter) is made over
that same token (file_urls.py).

A sandbox's ports (E2B's ``get_host``) are reached with its traffic access token, E2B's
``trafficAccessToken``, sent as the ``e2b-traffic-access-token`` header: an HMAC of the sandbox id
under the same key, for another purpose than the envd token, so neither stands in for the other.

The volume content API is reached with a per-volume token, E2B's volume ``token``: the control API's
answers for a volume carry it and the SDK sends it as ``Authorization: Bearer``. It names the tenant it
was given to and is an HMAC, under the same key, of that tenant, the volume's name and the moment the
volume was made: it opens one volume for one tenant (who may do there what the tenant may), needs no
table, and stops working when the volume is removed (one made again under the name is another) or the
tenant is.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import secrets
from datetime import datetime
from pathlib import Path

from ..errors import DsecError
from ..store.tenants import TenantStore
from ..tenancy import ADMIN, OPERATOR, Caller

KEY_FILE = "e2b.key"


def load_key(state_dir: Path) -> bytes:
    """The daemon's envd token key, made (0600) at first start."""
    path = state_dir / KEY_FILE
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    key = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.replace(tmp, path)
    return key


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key == name:
            return value
    return b""


def api_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The API key of a control-API call: ``X-API-KEY``, else an ``Authorization: Bearer`` token."""
    key = header(headers, b"x-api-key").strip()
    if key:
        return key
    scheme, _, token = header(headers, b"authorization").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def identify(token: bytes, operator_token: str, tenants: TenantStore) -> Caller | None:
    """The caller behind a dsec token (the operator's, or a tenant's from the tenant store)."""
    if not token:
        return None
    if secrets.compare_digest(token, operator_token.encode()):
        return OPERATOR
    return tenants.identify(token)


def owner_caller(owner: str | None) -> Caller:
    """The caller an envd call acts as: the sandbox's owner (the operator's own sandboxes as the operator)."""
    if owner is None or owner == OPERATOR.tenant:
        return OPERATOR
    return Caller(owner)


class EnvdTokens:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, purpose: bytes, sandbox_id: str) -> str:
        mac = hmac.new(self._key, purpose + b"\0" + sandbox_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def token(self, sandbox_id: str) -> str:
        return self._mac(b"envd", sandbox_id)

    def check(self, sandbox_id: str, token: str) -> bool:
        return bool(token) and hmac.compare_digest(self.token(sandbox_id).encode(), token.encode())

    def traffic_token(self, sandbox_id: str) -> str:
        return self._mac(b"traffic", sandbox_id)

    def check_traffic(self, sandbox_id: str, token: str) -> bool:
        return bool(token) and hmac.compare_digest(self.traffic_token(sandbox_id).encode(), token.encode())


class VolumeTokens:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def token(self, caller: Caller, name: str, created_at: datetime) -> str:
        return f"{caller.tenant}.{self._mac(caller.tenant, name, created_at)}"

    def _mac(self, tenant: str, name: str, created_at: datetime) -> str:
        message = "\0".join(("volume", tenant, name, created_at.isoformat())).encode()
        return base64.urlsafe_b64encode(hmac.new(self._key, message, hashlib.sha256).digest()).rstrip(b"=").decode()

    @staticmethod
    def holder(token: str, tenants: TenantStore) -> Caller | None:
        """Whom a token was given to, if that tenant still is (the MAC is checked by ``opens``)."""
        tenant, dot, mac = token.rpartition(".")
        if not dot or not tenant or not mac:
            return None
        if tenant == ADMIN:
            return OPERATOR
        try:
            found = tenants.get(tenant)
        except DsecError:
            return None
        return None if found.revoked_at is not None or found.operator else found.caller

    def opens(self, token: str, caller: Caller, name: str, created_at: datetime) -> bool:
        want = self.token(caller, name, created_at)
        return hmac.compare_digest(want.encode(), token.encode())
