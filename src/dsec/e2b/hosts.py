"""Which sandbox port a request on the E2B listener is for: E2B's two ways of naming one.

E2B's SDKs reach a server in a sandbox at the host ``{port}-{sandbox id}.{domain}`` (``get_host``), and
E2B's proxy also routes by the ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers (what the SDKs send
to envd at the one sandbox URL). Port 49983 is envd's: its calls are the E2B API's own. Kept free of the
core, so that the cluster gateway routes by the same rules without loading it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import InvalidRequest

ENVD_PORT = 49983
SANDBOX_HEADER = b"e2b-sandbox-id"
PORT_HEADER = b"e2b-sandbox-port"
TRAFFIC_HEADER = b"e2b-traffic-access-token"
ACCESS_HEADER = b"x-access-token"  # envd's: the sandbox's access token
ROUTING = frozenset({SANDBOX_HEADER, PORT_HEADER, TRAFFIC_HEADER})  # end at the proxy, never reach the server
# E2B's maskRequestHost, kept as a label of the sandbox: the Host its servers are told, ${PORT} the port
META_MASK_HOST = "dsec.e2b.mask-host"
# E2B's allowPublicTraffic=true, kept as a label: the sandbox's ports answer without its traffic token
META_PUBLIC_TRAFFIC = "dsec.e2b.public-traffic"
MASK_HOST = r"^(?:[A-Za-z0-9-]{1,63}\.)*[A-Za-z0-9-]{1,63}(?::(?:[0-9]{1,5}|\$\{PORT\}))?$"
MAX_MASK_HOST = 200


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    return next((v for k, v in headers if k == name), b"").decode("latin-1").strip()


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise InvalidRequest(f"a sandbox's port is a number of 1-65535, not {text[:20]!r}")
    return int(text)


def sandbox_port(headers: list[tuple[bytes, bytes]], domain: str | None) -> tuple[str, int] | None:
    """(sandbox id, port) of a request for a server in a sandbox, by its Host ``PORT-ID.DOMAIN`` or E2B's
    routing headers; None for a call of the E2B API itself (envd's port included)."""
    host = _header(headers, b"host")
    if domain and host.lower().endswith("." + domain):
        port_text, dash, sandbox_id = host[: -len(domain) - 1].partition("-")
        if dash and sandbox_id and port_text.isdigit():
            port = _port(port_text)
            return None if port == ENVD_PORT else (sandbox_id, port)
    port_text = _header(headers, PORT_HEADER)
    sandbox_id = _header(headers, SANDBOX_HEADER)
    if not port_text or not sandbox_id or port_text == str(ENVD_PORT):
        return None
    return sandbox_id, _port(port_text)


def check_mask(mask: str) -> str:
    """E2B's maskRequestHost: a host name, perhaps with ``:PORT`` or ``:${PORT}`` (the port reached)."""
    if len(mask) > MAX_MASK_HOST or not re.fullmatch(MASK_HOST, mask):
        raise InvalidRequest(
            f"network.maskRequestHost {mask[:80]!r}: expected a host name, optionally with :PORT or :${{PORT}}"
        )
    return mask


def masked_host(labels: Mapping[str, str], port: int) -> str | None:
    """The Host a sandbox's server is told for ``port``: its maskRequestHost, or None (its own address)."""
    mask = labels.get(META_MASK_HOST)
    return mask.replace("${PORT}", str(port)) if mask else None


def envd_sandbox(headers: list[tuple[bytes, bytes]], domain: str | None) -> str | None:
    """The sandbox of an envd call made at its own host, ``49983-ID.DOMAIN`` (what the SDKs' file URLs
    name when no E2B_SANDBOX_URL is set); None for any other host, or without a domain."""
    host = _header(headers, b"host").lower()
    prefix = f"{ENVD_PORT}-"
    if not domain or not host.startswith(prefix) or not host.endswith("." + domain):
        return None
    sandbox_id = host[len(prefix) : -len(domain) - 1]
    return sandbox_id if sandbox_id and "." not in sandbox_id else None


def check_domain(domain: str | None) -> str | None:
    """A sandbox domain as E2B's SDKs put it after ``PORT-ID.``: a host name, perhaps with a port."""
    if domain is None:
        return None
    host, colon, port = domain.rpartition(":") if ":" in domain else (domain, "", "")
    labels = host.split(".")
    if (
        len(domain) > 200
        or not all(label and all(c.isascii() and (c.isalnum() or c == "-") for c in label) for label in labels)
        or (colon and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536))
    ):
        raise InvalidRequest(
            f"--e2b-domain {domain!r}: expected a host name, or HOST:PORT (e.g. sandboxes.example.com)"
        )
    return domain.lower()
