"""The network policy of a sandbox as a client states it, parsed and normalised.

``None``: loopback only. ``"full"``: anything but the unreachable set (host, daemon, metadata, other
sandboxes). ``{"allow": [...]}``: only the listed destinations, each ``CIDR:PORT``, ``IP:PORT`` or
``NAME:PORT`` with PORT a number or ``*``; tcp and udp alike. Names are resolved by the platform's
resolver, which answers only listed names for that sandbox. ``{"deny": [...], "allow": [...]}``: what
"full" reaches except the denied networks (``CIDR:PORT`` or ``IP:PORT``), the allowed destinations
reachable even so; the unreachable set stays unreachable.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

MAX_ENTRIES = 256
MAX_NAME = 253
_ADDRESSY = re.compile(r"^[0-9.]+$")  # an address (or a broken one), never a name
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
# Addresses a policy may never open: they are dropped before any allow rule anyway, and accepting
# them in a policy would only make the policy lie about what it allows.
FORBIDDEN_NETS = tuple(
    ipaddress.IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32")
)


@dataclass(frozen=True)
class AllowEntry:
    """One destination: a network or a name, and a port (None: any port)."""

    net: ipaddress.IPv4Network | None
    name: str | None
    port: int | None

    def __str__(self) -> str:
        where = self.name if self.name is not None else _net_text(self.net)
        return f"{where}:{'*' if self.port is None else self.port}"


def _net_text(net: ipaddress.IPv4Network | None) -> str:
    assert net is not None
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def valid_name(name: str) -> str:
    """A DNS name, lower-cased without its trailing dot; ValueError if it is not one."""
    name = name.lower()
    name = name[:-1] if name.endswith(".") else name
    if not name or len(name) > MAX_NAME:
        raise ValueError(f"name {name[:80]!r} is empty or longer than {MAX_NAME} characters")
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{name[:80]!r} is not a valid DNS name (letters, digits, '-', dot-separated labels)")
    if labels[-1].isdigit():
        raise ValueError(f"{name[:80]!r} looks like an address, not a name")
    return name


def parse_entry(text: str) -> AllowEntry:
    if not isinstance(text, str) or not text or len(text) > MAX_NAME + 10:
        raise ValueError(f"allow entry {str(text)[:80]!r} is empty or too long")
    where, sep, port_text = text.strip().rpartition(":")
    if not sep or not where:
        raise ValueError(f"allow entry {text!r} must look like CIDR:PORT, IP:PORT or NAME:PORT (PORT a number or *)")
    if port_text == "*":
        port = None
    elif port_text.isdigit() and len(port_text) <= 5 and 1 <= int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise ValueError(f"allow entry {text!r}: port must be 1-65535 or *")
    if ":" in where or "/" in where or _ADDRESSY.match(where):
        try:
            net = ipaddress.ip_network(where, strict=True)
        except ValueError as e:
            raise ValueError(f"allow entry {text!r}: {e}") from None
        if not isinstance(net, ipaddress.IPv4Network):
            raise ValueError(f"allow entry {text!r}: IPv6 is not routed to sandboxes")
        if any(net.overlaps(bad) for bad in FORBIDDEN_NETS):
            raise ValueError(
                f"allow entry {text!r}: loopback, link-local, multicast and reserved ranges stay unreachable"
            )
        return AllowEntry(net=net, name=None, port=port)
    return AllowEntry(net=None, name=valid_name(where), port=port)


# An allow entry as the schema states it: a name, an address, or a network on a whole-octet prefix
# (/8, /16, /24, /32) with its host octets zero, outside the unreachable ranges. What it leaves out is
# checked by parse_entry alone: other prefixes (host bits zero, no overlap with those ranges), names of
# more than 253 characters, white space around an entry.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# a first octet outside 0/8, 127/8, 169.254/16, 224/4 and 240/4 (169 apart: only 169.254 is out)
_FIRST = r"(?:[1-9]|[1-9][0-9]|1[01][0-9]|12[0-6]|12[89]|1[3-5][0-9]|16[0-8]|1[7-9][0-9]|2[01][0-9]|22[0-3])"
_FIRST_TWO = rf"(?:{_FIRST}\.{_OCTET}|169\.(?:25[0-35]|2[0-4][0-9]|1[0-9]{{2}}|[1-9]?[0-9]))"
_NETWORK = (
    rf"(?:{_FIRST_TWO}\.{_OCTET}\.{_OCTET}(?:/32)?|{_FIRST_TWO}\.{_OCTET}\.0/24|{_FIRST_TWO}\.0\.0/16"
    rf"|{_FIRST}\.0\.0\.0/8)"
)
_LABEL_TEXT = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = rf"(?:{_LABEL_TEXT}\.)*[A-Za-z](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\.?"  # the last label not a number
_PORT = (
    r"(?:\*|0{0,4}[1-9]|0{0,3}[1-9][0-9]|0{0,2}[1-9][0-9]{2}|0?[1-9][0-9]{3}|[1-5][0-9]{4}|6[0-4][0-9]{3}"
    r"|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
)
ALLOW_ENTRY = rf"^(?:{_NETWORK}|{_NAME}):{_PORT}$"
ALLOW_DESTINATION = rf"^(?:{_NETWORK}|{_NAME})$"  # an entry without its port (E2B's allowOut)
# 255: no entry that long names a name over 253 characters (':*' is the shortest port)
AllowEntryText = Annotated[
    str, WithJsonSchema({"type": "string", "minLength": 3, "maxLength": MAX_NAME + 2, "pattern": ALLOW_ENTRY})
]


class NetworkAllow(BaseModel):
    """Only these destinations: ``CIDR:PORT``, ``IP:PORT`` or ``NAME:PORT`` (PORT 1-65535 or ``*``), tcp and udp."""

    model_config = ConfigDict(extra="forbid")

    allow: list[AllowEntryText] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="Destinations, e.g. '10.1.2.0/24:443', '1.2.3.4:53', 'pypi.org:443', 'example.com:*' (a "
        "network's host bits zero; not loopback, link-local, multicast or reserved ranges).",
    )

    @field_validator("allow")
    @classmethod
    def _entries(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(str(parse_entry(e)) for e in v))

    def entries(self) -> list[AllowEntry]:
        return [parse_entry(e) for e in self.allow]


# a denied destination: a network or an address (no name: what a name resolves to changes), with a port
DENY_ENTRY = rf"^{_NETWORK}:{_PORT}$"
DenyEntryText = Annotated[
    str, WithJsonSchema({"type": "string", "minLength": 3, "maxLength": 24, "pattern": DENY_ENTRY})
]


def parse_deny(text: str) -> AllowEntry:
    entry = parse_entry(text)
    if entry.net is None:
        raise ValueError(f"deny entry {text!r}: a network or an address (CIDR:PORT, IP:PORT), not a name")
    return entry


class NetworkDeny(BaseModel):
    """What "full" reaches except the denied networks; the allowed destinations are reachable even so."""

    model_config = ConfigDict(extra="forbid")

    deny: list[DenyEntryText] = Field(
        ...,
        min_length=1,
        max_length=MAX_ENTRIES,
        description="Networks not reached, e.g. '8.8.8.8:*', '203.0.113.0/24:443' (a network's host bits zero).",
    )
    allow: list[AllowEntryText] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        description="Exceptions to deny, as an allowlist's entries ('CIDR:PORT', 'IP:PORT', 'NAME:PORT').",
    )

    @field_validator("deny")
    @classmethod
    def _denied(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(str(parse_deny(e)) for e in v))

    @field_validator("allow")
    @classmethod
    def _allowed(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(str(parse_entry(e)) for e in v))

    def entries(self) -> list[AllowEntry]:
        """The allowed exceptions."""
        return [parse_entry(e) for e in self.allow]

    def denied(self) -> list[AllowEntry]:
        return [parse_deny(e) for e in self.deny]


NetworkSpec = Literal["full"] | NetworkAllow | NetworkDeny | None


def to_json(policy: NetworkSpec) -> Any:
    return policy.model_dump() if isinstance(policy, NetworkAllow | NetworkDeny) else policy


def from_json(value: Any) -> NetworkSpec:
    """A policy as stored (None, "full", {"allow": [...]}, {"deny": [...], ...}); anything else reads as None."""
    if value == "full":
        return "full"
    if isinstance(value, dict):
        return NetworkDeny.model_validate(value) if "deny" in value else NetworkAllow.model_validate(value)
    return None


def describe(policy: NetworkSpec) -> str:
    if policy is None:
        return "none"
    if policy == "full":
        return "full"
    if isinstance(policy, NetworkDeny):
        return f"full but {len(policy.deny)} denied networks"
    return f"allow {len(policy.allow)} destinations"
