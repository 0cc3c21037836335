"""HTTP plumbing of the SDK: where the daemon is, the token, and turning error replies into exceptions."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from ..errors import DaemonUnreachable, DsecError, InvalidRequest, SandboxTimeout, error_from_wire
from .uds import TcpTransport, UnixTransport

DEFAULT_STATE_DIR = Path("/var/lib/dsec")
# Idle connections expire on our side first (the daemon keeps them 120 s), so a pooled connection is
# never one the daemon is closing at the moment a request goes out on it.
KEEPALIVE_EXPIRY = 30.0
DEFAULT_URL = f"unix://{DEFAULT_STATE_DIR / 'dsec.sock'}"
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# A call whose connection broke is sent again this many times (with its Idempotency-Key, if it has one)
RETRIES = 2
RETRY_DELAY = 0.2


def resolve_target(url: str | None, token: str | None) -> tuple[str, str | None]:
    """URL and token from arguments, then DSEC_URL / DSEC_TOKEN, then the local daemon's defaults."""
    url = url or os.environ.get("DSEC_URL") or DEFAULT_URL
    token = token or os.environ.get("DSEC_TOKEN")
    if token is None:
        parsed = urlparse(url)
        candidates = [DEFAULT_STATE_DIR / "token"]
        if parsed.scheme == "unix" and parsed.path:
            candidates.insert(0, Path(parsed.path).parent / "token")
        for candidate in candidates:
            try:
                token = candidate.read_text().strip()
                break
            except OSError:
                continue
    return url, token


def make_http(url: str, token: str | None) -> httpx.AsyncClient:
    parsed = urlparse(url)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if parsed.scheme == "unix":
        transport = UnixTransport(parsed.path, keepalive_expiry=KEEPALIVE_EXPIRY)
        return httpx.AsyncClient(transport=transport, base_url="http://dsec", headers=headers, timeout=None)
    if parsed.scheme == "http" and parsed.hostname and not parsed.path.strip("/"):
        tcp = TcpTransport(parsed.hostname, parsed.port or 80, keepalive_expiry=KEEPALIVE_EXPIRY)
        return httpx.AsyncClient(transport=tcp, base_url=url.rstrip("/"), headers=headers, timeout=None)
    if parsed.scheme in ("http", "https"):
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=KEEPALIVE_EXPIRY)
        return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=None, limits=limits)
    raise InvalidRequest(f"unsupported daemon URL {url!r}: use unix:///path or http(s)://host:port")


def with_key(method: str, headers: Any, key: str | None) -> dict[str, str]:
    """``headers`` with an Idempotency-Key when ``method`` changes something (one the caller set wins)."""
    out = dict(headers or {})
    if method in MUTATING and not any(k.lower() == "idempotency-key" for k in out):
        out["Idempotency-Key"] = key or new_key()
    return out


def new_key() -> str:
    return secrets.token_urlsafe(18)


def raise_for_reply(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        err = json.loads(body)["error"]
        code, message, detail = str(err["code"]), str(err["message"]), err.get("detail") or {}
    except (ValueError, KeyError, TypeError):
        raise DsecError(f"daemon answered HTTP {status}: {body[:500].decode(errors='replace')}") from None
    raise error_from_wire(code, message, detail)


class Transport:
    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        self.url, self.token = resolve_target(url, token)
        self.http = make_http(self.url, self.token)

    def public_url(self, path: str) -> str:
        """``path`` on the daemon's listener as a URL anyone can use: only a daemon on TCP has one."""
        if not self.url.startswith(("http://", "https://")):
            raise InvalidRequest(
                f"this client reaches the daemon at {self.url}, which no other program can use: exposed ports "
                "need the daemon on TCP (dsec serve --listen http://HOST:PORT) and DSEC_URL pointing there"
            )
        return self.url.rstrip("/") + path

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None = 120.0,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One call. A mutating one carries an Idempotency-Key (``idempotency_key``, or a fresh one), so
        when the connection breaks after the request went out it is sent again with the same key: the
        daemon answers a repeat from memory, and nothing runs twice."""
        kwargs["headers"] = with_key(method, kwargs.get("headers"), idempotency_key)
        for attempt in range(RETRIES + 1):
            try:
                reply = await self.http.request(method, path, timeout=timeout, **kwargs)
                break
            except httpx.TimeoutException as e:
                raise SandboxTimeout(f"the daemon did not answer {method} {path} within {timeout}s") from e
            except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as e:
                raise DaemonUnreachable(
                    f"cannot reach the dsec daemon at {self.url}: {e} (is `dsec serve` running?)"
                ) from e
            except httpx.InvalidURL as e:  # a 100 kB path, say: refused before anything is sent
                raise InvalidRequest(f"cannot send {method} {path[:200]}: {e}") from None
            except (httpx.TransportError, ConnectionError) as e:
                if attempt < RETRIES and not isinstance(kwargs.get("content"), AsyncIterable):
                    await asyncio.sleep(RETRY_DELAY * (attempt + 1))
                    continue
                # the connection broke after the request may have been sent: it may or may not have run
                raise DaemonUnreachable(
                    f"the connection to the dsec daemon at {self.url} broke during {method} {path}: "
                    f"{type(e).__name__}: {e or 'no detail'}; the call may or may not have taken effect"
                ) from e
        raise_for_reply(reply.status_code, reply.content)
        return reply

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[httpx.Response]:
        """A streamed call; not sent again when its connection breaks (what it streamed was seen), but it
        carries an Idempotency-Key all the same, so a pooled connection's resend cannot run it twice."""
        kwargs["headers"] = with_key(method, kwargs.get("headers"), None)
        try:
            async with self.http.stream(method, path, timeout=timeout, **kwargs) as reply:
                if reply.status_code >= 400:
                    raise_for_reply(reply.status_code, await reply.aread())
                yield reply
        except httpx.InvalidURL as e:
            raise InvalidRequest(f"cannot send {method} {path[:200]}: {e}") from None
        except (httpx.TransportError, FileNotFoundError, ConnectionError) as e:
            raise DaemonUnreachable(f"cannot reach the dsec daemon at {self.url} (or it went away): {e}") from e

    async def aclose(self) -> None:
        await self.http.aclose()
