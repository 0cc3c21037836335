"""Static resolver entries for the platform resolver (``dsec serve --resolve NAME=IP``, like curl's
--resolve)."""

from __future__ import annotations

import ipaddress

from ...errors import InvalidRequest
from ...protocol.network import valid_name


def parse_resolve(items: list[str]) -> dict[str, list[str]]:
    """NAME=IP entries (repeat a name for several addresses) as name -> addresses."""
    hosts: dict[str, list[str]] = {}
    for item in items:
        name, sep, addr = item.strip().partition("=")
        try:
            if not sep:
                raise ValueError("expected NAME=IP")
            ip = ipaddress.ip_address(addr.strip())
            if not isinstance(ip, ipaddress.IPv4Address):
                raise ValueError("only IPv4 addresses are routed to sandboxes")
            hosts.setdefault(valid_name(name.strip()), []).append(str(ip))
        except ValueError as e:
            raise InvalidRequest(f"--resolve {item!r}: {e}") from None
    return hosts
