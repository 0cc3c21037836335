"""The node API's callers: routes receive the request's ``Caller`` (web/auth.py resolves it) through
these dependencies, which refuse a call without one, or one that is not the operator's."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..errors import Forbidden, Unauthorized
from ..tenancy import Caller
from ..web.auth import resolve


async def authorize(request: Request) -> Caller:
    caller = resolve(request.scope)
    if caller is None:
        raise Unauthorized("missing, wrong or revoked bearer token (see DSEC_TOKEN and the daemon's STATE_DIR/token)")
    return caller


async def operator(request: Request) -> Caller:
    caller = await authorize(request)
    if not caller.operator:
        raise Forbidden("only the operator (the daemon's STATE_DIR/token) may do this")
    return caller


CallerDep = Annotated[Caller, Depends(authorize)]
OperatorDep = Annotated[Caller, Depends(operator)]
