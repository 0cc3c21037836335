"""Tenant administration (operator only) and the audit log (each tenant its own records)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import WithJsonSchema

from ..protocol.names import TenantName
from ..protocol.sandbox import (
    AuditList,
    AuditRecord,
    TenantCreate,
    TenantCreated,
    TenantInfo,
    TenantList,
    TenantRemoved,
)
from ..protocol.types import TIME_SCHEMA
from ..store.audit import Entry
from ..store.tenants import Tenant
from .auth import CallerDep, OperatorDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)


def _at(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _tenant(t: Tenant, live: int) -> TenantInfo:
    return TenantInfo(
        name=t.name,
        created_at=datetime.fromtimestamp(t.created_at, UTC),
        operator=t.operator,
        revoked_at=_at(t.revoked_at),
        sandboxes=live,
    )


@router.post("/tenants", response_model=TenantCreated, status_code=201)
async def create_tenant(body: TenantCreate, mgr: Mgr, _: OperatorDep) -> TenantCreated:
    """A new tenant and its bearer token, shown this once (only its hash is kept). Operator only."""
    tenant, token = mgr.tenants.add(body.name)
    return TenantCreated(name=tenant.name, token=token, created_at=datetime.fromtimestamp(tenant.created_at, UTC))


@router.get("/tenants", response_model=TenantList)
async def list_tenants(mgr: Mgr, _: OperatorDep) -> TenantList:
    """Every tenant, removed ones included (a name is never reused). Operator only."""
    return TenantList(tenants=[_tenant(t, mgr.live_count(t.name)) for t in mgr.tenants.list()])


@router.delete("/tenants/{name}", response_model=TenantRemoved)
async def remove_tenant(name: TenantName, mgr: Mgr, _: OperatorDep) -> TenantRemoved:
    """Revoke the tenant's token at once and kill its live sandboxes; its images stay. Operator only."""
    revoked_at, killed = await mgr.remove_tenant(name)
    return TenantRemoved(name=name, revoked_at=datetime.fromtimestamp(revoked_at, UTC), killed=killed)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def _record(e: Entry) -> AuditRecord:
    return AuditRecord(
        # floored to the microsecond (fromtimestamp rounds): the time a client pages back ``until`` with
        # must not be later than the record's own, or the record would come again
        time=_EPOCH + math.floor(e.time * 1_000_000) * _US,
        tenant=e.tenant,
        method=e.method,
        route=e.route,
        sandbox=e.sandbox,
        status=e.status,
        duration_ms=e.duration_ms,
        command=e.command,
    )


@router.get("/audit", response_model=AuditList)
async def audit(
    mgr: Mgr,
    caller: CallerDep,
    sandbox: Annotated[str | None, Query(max_length=64, description="Only calls on this sandbox.")] = None,
    tenant: Annotated[
        str | None, Query(max_length=63, description="Operator only: only this tenant's calls (others: their own).")
    ] = None,
    since: Annotated[
        datetime | None,
        Query(description="Only calls at or after this time (ISO 8601 or epoch seconds)."),
        WithJsonSchema(TIME_SCHEMA),
    ] = None,
    until: Annotated[
        datetime | None,
        Query(
            description="Only calls before this time (ISO 8601 or epoch seconds), to the microsecond: to page "
            "back, pass the oldest `time` received. A page never ends inside a microsecond (it may exceed "
            "`limit` to hold all of its oldest one's calls), so paging this way skips and repeats none."
        ),
        WithJsonSchema(TIME_SCHEMA),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="The newest this many.")] = 100,
) -> AuditList:
    """Audited API calls, oldest first: the caller's own; the operator's view has everyone's, refused
    calls (tenant null) included. Newest first by time when choosing which: page back with ``until``."""
    if not caller.operator:
        # a tenant asking for someone else's records gets its own filter applied, never theirs
        tenant = caller.tenant
    entries = await mgr.audit.query(
        tenant=tenant,
        sandbox=sandbox,
        since=None if since is None else since.timestamp(),
        until=None if until is None else until.timestamp(),
        limit=limit,
        include_unknown=caller.operator,
    )
    return AuditList(records=[_record(e) for e in entries])
