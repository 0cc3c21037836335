"""E2B's egress rules (``network`` of a create, ``PUT /sandboxes/{id}/network``) as dsec network policies."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from fastapi import Body, Response
from pydantic import ValidationError

from ..errors import InvalidRequest, validation_message
from ..protocol import network as policy
from ..protocol.network import FORBIDDEN_NETS, NetworkAllow, NetworkDeny, NetworkSpec
from . import control_models as m
from .control_common import UNSUPPORTED, Svc, Who, live_info, parse, router
from .control_doc import doc


def _unreachable(entry: str) -> bool:
    """A network dsec never reaches anyway (loopback, link-local and metadata, multicast, reserved)."""
    try:
        net = ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return False
    return isinstance(net, ipaddress.IPv4Network) and any(net.subnet_of(bad) for bad in FORBIDDEN_NETS)


def network_spec(allow_internet: bool | None, net: m.NetworkConfig | None, default: NetworkSpec) -> NetworkSpec:
    """E2B's egress rules as a dsec policy: "deny everything" (denyOut 0.0.0.0/0, or
    allowInternetAccess=false) with allowOut exceptions is an allowlist; denying some networks is "full"
    but those (allowOut still reaching past them). E2B's entries have no port: each means every port.
    dsec's own denials (the host, the daemon, metadata, private ranges, other sandboxes) hold in all."""
    allow: list[str] = []
    deny: list[str] = []
    if net is not None:
        for name in ("rules", "egress_proxy", "dns_servers", "https_ports"):
            if getattr(net, name) not in (None, [], {}):
                alias = m.NetworkConfig.model_fields[name].alias or name
                raise InvalidRequest(f"network.{alias} {UNSUPPORTED}")
        allow, deny = list(net.allow_out or []), list(net.deny_out or [])
    deny_all = allow_internet is False or any(d.strip() in ("0.0.0.0/0", "::/0") for d in deny)
    deny = [d for d in deny if not _unreachable(d)]  # denied whatever the policy says
    if deny and not deny_all:
        try:
            return NetworkDeny(deny=[f"{d.strip()}:*" for d in deny], allow=[f"{a.strip()}:*" for a in allow])
        except ValidationError as e:
            raise InvalidRequest(f"network.denyOut/allowOut: {validation_message(e)}") from None
    if deny_all:
        if not allow:
            return None
        try:
            # E2B's entries have no port: each allows every port of its address, range or name
            return NetworkAllow(allow=[f"{a.strip()}:*" for a in allow])
        except ValidationError as e:
            raise InvalidRequest(f"network.allowOut: {validation_message(e)}") from None
    if net is None and allow_internet is None:
        return default
    return "full"


@router.put("/sandboxes/{sandbox_id}/network", **doc(204, None, m.NetworkUpdate))
async def update_network(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: m.NetworkUpdate = parse(m.NetworkUpdate, body)
    if req.rules:
        raise InvalidRequest(f"network rules {UNSUPPORTED}")
    net = m.NetworkConfig(allowOut=req.allow_out, denyOut=req.deny_out)
    spec = network_spec(req.allow_internet_access, net, "full")
    live_info(svc, sandbox_id, caller)
    rec = svc.mgr.record(sandbox_id, caller=caller)
    await svc.call(rec, "set_network", {"policy": policy.to_json(spec)}, caller=caller)
    return Response(status_code=204)
