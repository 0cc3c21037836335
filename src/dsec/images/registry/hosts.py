"""Where a registry's requests go and how: TLS or plain HTTP, which CA, which mirrors first.

The rule for plain HTTP is Docker's, made stricter in one way. A registry is spoken to over TLS, verified
against the system's CAs plus the host's own CA bundle if one is configured. Registries on a loopback
address (``localhost``, 127.0.0.0/8, ``::1``) and hosts named insecure may also be spoken to in plain HTTP:
TLS is tried first and plain HTTP only if that fails, as Docker does. Unlike Docker, an insecure host never
gets TLS without verification: a host whose certificate cannot be verified is refused over TLS and then
tried in plain HTTP, which a TLS-only server refuses, so the error says what failed. Whether an address is
loopback is read from the reference itself, never looked up in DNS, so a name cannot be made "local" by
whoever answers for it.

Mirrors (``docker.io=https://mirror.example``) are tried in the order given, before the registry itself.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import httpx

from ...errors import InvalidRequest
from .reference import DOCKER_HUB, split_host_port

__all__ = ["DOCKER_HUB_API", "Endpoint", "RegistryHosts", "host_key", "is_loopback"]

DOCKER_HUB_API = "registry-1.docker.io"  # where docker.io's API answers
_HUB_ALIASES = frozenset({DOCKER_HUB, "index.docker.io", DOCKER_HUB_API})


def host_key(host: str) -> str:
    """A registry host as configuration names it: lower-case, Docker Hub's aliases as ``docker.io``."""
    key = host.strip().lower()
    return DOCKER_HUB if key in _HUB_ALIASES else key


def is_loopback(host_port: str) -> bool:
    """Whether ``host[:port]`` names this machine by a loopback address or ``localhost`` (no DNS lookup)."""
    try:
        host, _ = split_host_port(host_port)
    except ValueError:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Endpoint:
    """One place to send a registry's requests: the registry itself or one of its mirrors."""

    registry: str  # the registry the content belongs to (a reference's registry)
    host: str  # host[:port] the requests go to
    schemes: tuple[str, ...]  # in the order to try: ("https",) or ("https", "http") or ("http",)
    prefix: str = ""  # a mirror's path before /v2/
    mirror: bool = False

    @property
    def credentials_key(self) -> str:
        """Whose credentials apply: the registry's for itself, the mirror's own host for a mirror."""
        return host_key(self.host) if self.mirror else host_key(self.registry)

    def label(self) -> str:
        if self.mirror:
            return f"mirror {self.schemes[0]}://{self.host}{self.prefix} of {self.registry}"
        return f"registry {self.registry}"


@dataclass(frozen=True)
class RegistryHosts:
    """How to reach registries: mirrors per registry, hosts allowed plain HTTP, CA bundles per host.

    Keys are ``host`` or ``host:port`` (a key without a port covers every port of the host); ``insecure`` may
    also hold CIDR ranges (``10.0.0.0/8``) that cover IP-address hosts."""

    mirrors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    insecure: frozenset[str] = frozenset()
    ca_files: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def from_options(
        cls,
        *,
        mirrors: Iterable[str] = (),
        insecure: Iterable[str] = (),
        ca_files: Mapping[str, str | Path] | None = None,
    ) -> RegistryHosts:
        """From command-line style options: ``mirrors`` as ``registry=url`` (repeatable, in order)."""
        by_registry: dict[str, list[str]] = {}
        for spec in mirrors:
            registry, eq, url = spec.partition("=")
            if not eq or not registry.strip() or not url.strip():
                raise InvalidRequest(
                    f"invalid registry mirror {spec!r}: expected registry=url, e.g. docker.io=https://..."
                )
            by_registry.setdefault(host_key(registry), []).append(url.strip())
        cas: dict[str, Path] = {}
        for host, path in (ca_files or {}).items():
            p = Path(path)
            if not p.is_file():
                raise InvalidRequest(f"CA bundle {p} for registry {host} is not a readable file")
            cas[host_key(host)] = p
        hosts = cls(
            mirrors={k: tuple(v) for k, v in by_registry.items()},
            insecure=frozenset(host_key(h) for h in insecure),
            ca_files=cas,
        )
        for registry in hosts.mirrors:
            hosts.endpoints(registry)  # a malformed or plain-HTTP mirror URL is refused now, not at first pull
        return hosts

    @cached_property
    def _insecure_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        nets = []
        for entry in self.insecure:
            if "/" in entry:
                try:
                    nets.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise InvalidRequest(f"invalid insecure registry range {entry!r}") from None
        return tuple(nets)

    def plain_http_allowed(self, host_port: str) -> bool:
        key = host_key(host_port)
        if is_loopback(key) or key in self.insecure:
            return True
        try:
            host, _ = split_host_port(key)
        except ValueError:
            return False
        if host in self.insecure:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in net for net in self._insecure_networks)

    def ca_file(self, host_port: str) -> Path | None:
        key = host_key(host_port)
        found = self.ca_files.get(key)
        if found is None:
            try:
                found = self.ca_files.get(split_host_port(key)[0])
            except ValueError:
                return None
        return found

    def ssl_context(self, host_port: str) -> ssl.SSLContext | None:
        """The TLS context for ``host_port`` when it has its own CA (added to the system's), else None."""
        ca = self.ca_file(host_port)
        if ca is None:
            return None
        context = ssl.create_default_context()
        try:
            context.load_verify_locations(cafile=str(ca))
        except (OSError, ssl.SSLError) as e:
            raise InvalidRequest(f"cannot load the CA bundle {ca} for registry {host_port}: {e}") from None
        return context

    def endpoints(self, registry: str) -> list[Endpoint]:
        """Where to send requests for ``registry``'s content: its mirrors in order, then itself."""
        found = [self._mirror(registry, url) for url in self.mirrors.get(host_key(registry), ())]
        host = DOCKER_HUB_API if host_key(registry) == DOCKER_HUB else registry
        found.append(Endpoint(registry, host, self._schemes(host)))
        return found

    def _schemes(self, host: str) -> tuple[str, ...]:
        # a host with its own CA speaks TLS: that is why it has one
        if self.plain_http_allowed(host) and self.ca_file(host) is None:
            return ("https", "http")
        return ("https",)

    def _mirror(self, registry: str, url: str) -> Endpoint:
        if "://" not in url:  # a bare host: reached like a registry of that name
            return Endpoint(registry, url, self._schemes(url), mirror=True)
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as e:
            raise InvalidRequest(f"invalid mirror URL {url!r} for {registry}: {e}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host or parsed.query or parsed.fragment:
            raise InvalidRequest(f"invalid mirror URL {url!r} for {registry}: expected http(s)://host[:port][/path]")
        host = parsed.netloc.decode("ascii")
        if parsed.scheme == "http" and not self.plain_http_allowed(host):
            raise InvalidRequest(
                f"mirror {url} for {registry} is plain HTTP, but {host} is neither a loopback address nor a host "
                "named insecure"
            )
        prefix = parsed.path.rstrip("/").removesuffix("/v2")
        return Endpoint(registry, host, (parsed.scheme,), prefix=prefix, mirror=True)
