"""HTTP plumbing of the SDK: where the daemon is, the token, and turning error replies into exceptions."""

from __future__ import annotations

import asyncio
import json
import os
import re
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
# what Transport sends without httpx: paths of unreserved characters (no query, nothing to quote), headers
# that need no encoding
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._~/-]*")
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_VALUE = re.compile(r"[\x20-\x7e]*")


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


def own_transport(url: str) -> UnixTransport | None:
    """The SDK's own transport for a daemon's unix socket or plain-HTTP port; None: httpx's (https)."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        return UnixTransport(parsed.path, keepalive_expiry=KEEPALIVE_EXPIRY)
    if parsed.scheme == "http" and parsed.hostname and not parsed.path.strip("/"):
        return TcpTransport(parsed.hostname, parsed.port or 80, keepalive_expiry=KEEPALIVE_EXPIRY)
    return None


def make_http(url: str, token: str | None, own: UnixTransport | None = None) -> httpx.AsyncClient:
    """``own``: ``own_transport(url)``, made by the caller that also sends on it directly."""
    parsed = urlparse(url)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    own = own or own_transport(url)
    if own is not None:
        base = "http://dsec" if parsed.scheme == "unix" else url.rstrip("/")
        return httpx.AsyncClient(transport=own, base_url=base, headers=headers, timeout=None)
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
        own = own_transport(self.url)
        self.http = make_http(self.url, self.token, own)
        # Calls with a JSON or no body skip httpx's request and response objects and go to the SDK's own
        # transport as bytes, while ``http`` is still the client made here (tests swap in others) and no
        # event hook would miss them.
        self._lane = (self.http, own)
        self._host = b"host: %s\r\n" % self.http.base_url.netloc

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
        raw = self._raw_request(method, path, kwargs)
        for attempt in range(RETRIES + 1):
            try:
                if raw is not None and self._lane[1] is not None:
                    reply = await self._lane[1].exchange(raw, timeout)
                else:
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

    def _raw_request(self, method: str, path: str, kwargs: dict[str, Any]) -> bytes | None:
        """The request as bytes when it can skip httpx (see ``__init__``); else None."""
        http, own = self._lane
        if own is None or http is not self.http or not set(kwargs) <= {"headers", "json"}:
            return None
        if http.event_hooks["request"] or http.event_hooks["response"] or not _PLAIN_PATH.fullmatch(path):
            return None
        head = [b"%s %s HTTP/1.1\r\n" % (method.encode(), path.encode()), self._host]
        own_names = {name.lower().encode() for name in kwargs["headers"]}  # a call's header wins, as in httpx
        head += [b"%s: %s\r\n" % (k, v) for k, v in http.headers.raw if k.lower() not in own_names]
        for name, value in kwargs["headers"].items():
            if not (_TOKEN.fullmatch(name) and _VALUE.fullmatch(value)):
                return None  # httpx's checks and errors, not ours
            head.append(b"%s: %s\r\n" % (name.encode(), value.encode()))
        body = b""
        if kwargs.get("json") is not None:
            # as httpx encodes a JSON body
            text = json.dumps(kwargs["json"], ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            body = text.encode()
            head.append(b"content-type: application/json\r\n")
        if body or method in MUTATING:
            head.append(b"content-length: %d\r\n" % len(body))
        head += [b"\r\n", body]
        return b"".join(head)

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
