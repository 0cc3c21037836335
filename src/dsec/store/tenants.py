"""Tenants and their API tokens, in the daemon's state database.

Only a token's SHA-256 is stored. Tokens are 256 random bits, so a fast unsalted hash is enough: nobody
can invert it, and looking a token up by its hash (a dict probe) leaks through timing at most a
prefix of a hash nobody can aim at. Every request resolves its token here, so the table is mirrored
in memory and SQLite is touched only when tenants are added or revoked.

A removed tenant is kept as a revoked row: its name is never given to another tenant, because images
and audit records still name it.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import Forbidden, InvalidRequest, InvalidState, NotFound, TenantExists
from ..protocol.names import check_tenant_name
from ..protocol.node import TenantQuota
from ..tenancy import ADMIN, OPERATOR, Caller
from .db import open_private

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    token_hash TEXT UNIQUE,
    created_at REAL NOT NULL,
    operator INTEGER NOT NULL DEFAULT 0,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS tenant_quotas (
    name TEXT PRIMARY KEY,
    quota TEXT NOT NULL
);
"""
TOKEN_PREFIX = "dsect_"  # tells a tenant token from the operator's at a glance (logs, leaked-secret scanners)


def token_hash(token: str | bytes) -> str:
    raw = token.encode(errors="replace") if isinstance(token, str) else token
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    created_at: float
    operator: bool = False
    revoked_at: float | None = None

    @property
    def caller(self) -> Caller:
        return OPERATOR if self.operator else Caller(self.name)


class TenantStore:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = open_private(path, SCHEMA, busy_timeout_ms=5000)  # the sandbox store writes the same file
        self._by_hash: dict[str, Caller] = {}
        self._tenants: dict[str, Tenant] = {}
        for name, digest, created, operator, revoked in self._db.execute("SELECT * FROM tenants"):
            tenant = Tenant(str(name), float(created), bool(operator), None if revoked is None else float(revoked))
            self._tenants[tenant.name] = tenant
            if digest is not None and revoked is None:
                self._by_hash[str(digest)] = tenant.caller
        self._quotas: dict[str, TenantQuota] = {
            str(name): TenantQuota.model_validate_json(raw)
            for name, raw in self._db.execute("SELECT name, quota FROM tenant_quotas")
        }

    def close(self) -> None:
        self._db.close()

    def identify(self, token: str | bytes) -> Caller | None:
        """The caller a bearer token belongs to; None for an unknown or revoked token."""
        if not token:
            return None
        return self._by_hash.get(token_hash(token))

    def set_operator_token(self, token: str) -> None:
        """Make ``token`` (the daemon's STATE_DIR/token) the operator's; called at every start."""
        digest = token_hash(token)
        if self._by_hash.get(digest) == OPERATOR:
            return
        with self._lock:
            created = self._tenants[ADMIN].created_at if ADMIN in self._tenants else time.time()
            self._db.execute(
                "INSERT OR REPLACE INTO tenants VALUES (?,?,?,1,NULL)",
                (ADMIN, digest, created),
            )
            self._by_hash = {h: c for h, c in self._by_hash.items() if not c.operator}
            self._by_hash[digest] = OPERATOR
            self._tenants[ADMIN] = Tenant(ADMIN, created, operator=True)

    def add(self, name: str) -> tuple[Tenant, str]:
        """A new tenant and its token; the token is returned here once and never stored."""
        check_tenant_name(name)
        if name == ADMIN:  # whatever the table holds: a tenant named so would own the operator's sandboxes
            raise TenantExists(f"tenant {ADMIN!r} is the operator")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            existing = self._tenants.get(name)
            if existing is not None:
                why = "was removed; a name is never reused" if existing.revoked_at else "exists"
                raise TenantExists(f"tenant {name!r} {why}")
            tenant = Tenant(name, time.time())
            digest = token_hash(token)
            self._db.execute("INSERT INTO tenants VALUES (?,?,?,0,NULL)", (name, digest, tenant.created_at))
            self._tenants[name] = tenant
            self._by_hash[digest] = tenant.caller
        return tenant, token

    def quota(self, name: str) -> TenantQuota | None:
        """What the tenant may hold on this node at once; None: only the node's own bounds."""
        return self._quotas.get(name)

    def set_quota(self, name: str, quota: TenantQuota) -> TenantQuota:
        tenant = self.get(name)
        # the request is sound; the tenant's state refuses it
        if tenant.operator:
            raise InvalidState("the operator has no quota: the node's capacity bounds it")
        if tenant.revoked_at is not None:
            raise InvalidState(f"tenant {name!r} was removed")
        with self._lock:
            if quota == TenantQuota():
                self._db.execute("DELETE FROM tenant_quotas WHERE name = ?", (name,))
                self._quotas.pop(name, None)
            else:
                self._db.execute("INSERT OR REPLACE INTO tenant_quotas VALUES (?,?)", (name, quota.model_dump_json()))
                self._quotas[name] = quota
        return quota

    def get(self, name: str) -> Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            raise NotFound(f"no tenant {name!r}")
        return tenant

    def list(self) -> list[Tenant]:
        return sorted(self._tenants.values(), key=lambda t: (not t.operator, t.created_at, t.name))

    def revoke(self, name: str) -> Tenant:
        """Stop the tenant's token working at once; the row stays so the name is not reused."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a tenant name is required")
        tenant = self.get(name)
        if tenant.operator:
            raise Forbidden("the operator cannot be removed (its token is the daemon's STATE_DIR/token)")
        if tenant.revoked_at is not None:
            return tenant
        with self._lock:
            revoked = Tenant(tenant.name, tenant.created_at, revoked_at=time.time())
            self._db.execute(
                "UPDATE tenants SET token_hash = NULL, revoked_at = ? WHERE name = ?", (revoked.revoked_at, name)
            )
            self._tenants[name] = revoked
            self._by_hash = {h: c for h, c in self._by_hash.items() if c.tenant != name}
        return revoked
