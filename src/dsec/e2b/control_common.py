"""What the E2B control routes share: the router they register on, the caller and service they take,
and the answers they give (control.py and its modules by subject: lifecycle, snapshots, network)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from ..errors import InvalidRequest, SandboxNotFound, Unauthorized, validation_message
from ..protocol.sandbox import TERMINAL_STATES, SandboxInfo
from ..tenancy import Caller
from ..web.auth import name_caller
from . import control_models as m
from .auth import api_token, identify
from .service import META_TEMPLATE, E2BService

MAX_PAGE = 100


UNSUPPORTED = "is not supported by dsec's E2B API (see docs/e2b.md)"


def service(request: Request) -> E2BService:
    svc: E2BService = request.app.state.e2b
    return svc


async def api_caller(request: Request) -> Caller:
    svc = service(request)
    caller = identify(api_token(request.scope.get("headers", [])), svc.operator_token, svc.mgr.tenants)
    if caller is None:
        raise Unauthorized("missing or wrong API key: E2B_API_KEY must be a dsec token (the operator's or a tenant's)")
    name_caller(request.scope, caller)
    return caller


Svc = Annotated[E2BService, Depends(service)]
Who = Annotated[Caller, Depends(api_caller)]
router = APIRouter()


def parse(model: type[Any], raw: Any) -> Any:
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        raise InvalidRequest(validation_message(e)) from None


def sandbox_model(svc: E2BService, info: SandboxInfo) -> m.Sandbox:
    return m.Sandbox(
        template_id=info.labels.get(META_TEMPLATE, info.image),
        sandbox_id=info.id,
        envd_access_token=svc.tokens.token(info.id),
        traffic_access_token=svc.tokens.traffic_token(info.id),
        domain=svc.options.domain,
    )


def live_info(svc: E2BService, sandbox_id: str, caller: Caller) -> SandboxInfo:
    """A sandbox E2B still knows: a stopped one is not found, as it is for E2B."""
    info = svc.mgr.info(sandbox_id, caller=caller)
    if info.state in TERMINAL_STATES:
        raise SandboxNotFound(
            f"sandbox {sandbox_id} is {info.state.value}" + (f": {info.reason}" if info.reason else "")
        )
    return info


def json_answer(model: m._Out, status: int = 200) -> Response:
    return Response(model.wire(), status_code=status, media_type="application/json")


def page_token(at: float, key: str) -> str:
    """E2B's nextToken for a page ending at the item made at ``at`` (ties broken by ``key``)."""
    return base64.urlsafe_b64encode(json.dumps([at, key]).encode()).decode()


def page_after(token: str) -> tuple[float, str]:
    """What a nextToken of page_token's names; InvalidRequest for anything else."""
    try:
        at, key = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(at), str(key)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidRequest(f"invalid nextToken {token[:40]!r}") from None
