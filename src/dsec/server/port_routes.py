"""Exposed ports of a sandbox: expose one (its address on this listener comes back), list, unexpose.
The traffic itself is the port proxy's (port_proxy.py), which takes no API token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from ..protocol.ports import ExposedPort, ExposedPorts, ExposeRequest
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)

PortParam = Annotated[int, Path(ge=1, le=65535)]


@router.post("/sandboxes/{sandbox_id}/ports", response_model=ExposedPort)
async def expose_port(sandbox_id: str, body: ExposeRequest, mgr: Mgr, caller: CallerDep) -> ExposedPort:
    """Make a port of the sandbox's loopback reachable at the answer's ``path`` on this listener (the same
    path again if it is exposed already)."""
    return mgr.ports.expose(sandbox_id, body, caller=caller)


@router.get("/sandboxes/{sandbox_id}/ports", response_model=ExposedPorts)
async def list_ports(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> ExposedPorts:
    return ExposedPorts(ports=mgr.ports.list(sandbox_id, caller=caller))


@router.delete("/sandboxes/{sandbox_id}/ports/{port}", status_code=204)
async def unexpose_port(sandbox_id: str, port: PortParam, mgr: Mgr, caller: CallerDep) -> Response:
    """Its address stops working; connections already open stay until they close."""
    mgr.ports.unexpose(sandbox_id, port, caller=caller)
    return Response(status_code=204)
