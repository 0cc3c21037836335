"""A node's network settings: static resolver entries (``dsec serve --resolve``) and the networks that
``"full"`` does not reach (``dsec serve --full-deny``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ...errors import InvalidRequest
from ...protocol.network import FORBIDDEN_NETS

# Private and shared address space: where a node's own neighbours live (the cluster's gateway and
# daemons, the layer repository, Ray, a cloud's internal services). "full" means the internet.
DEFAULT_FULL_DENY = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "198.18.0.0/15")


@dataclass(frozen=True)
class NetworkOptions:
    static: dict[str, list[str]] = field(default_factory=dict)  # name -> IPv4 addresses
    full_deny: tuple[str, ...] = DEFAULT_FULL_DENY


def parse_full_deny(items: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """CIDRs for ``--full-deny`` (repeatable); ``none`` alone: "full" reaches private networks too."""
    if [i.strip().lower() for i in items] == ["none"]:
        return ()
    nets = []
    for item in items:
        try:
            net = ipaddress.IPv4Network(item.strip(), strict=False)
        except ValueError as e:
            raise InvalidRequest(f"--full-deny {item!r}: not an IPv4 network ({e}); or use 'none' alone") from None
        if any(net.subnet_of(bad) for bad in FORBIDDEN_NETS):
            continue  # unreachable in every mode anyway
        nets.append(net)
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))
