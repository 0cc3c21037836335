"""HTTP for registries: one request at a time, authorised, redirected safely, retried, and failed clearly.

Everything here has a deadline: connecting, each read, and the whole of a small request. Failures that may
pass (the network, a server error, a rate limit) are retried with backoff a bounded number of times; the
others become the dsec error that says what happened and where (``RegistryUnreachable`` naming the host,
``RegistryAuthFailed`` naming the registry and whose credentials, the caller's not-found error).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import httpx

from ...errors import DsecError, RegistryAuthFailed, RegistryError, RegistryUnreachable
from ...protocol.version import __version__
from .auth import MAX_TOKEN_ANSWER, Authenticator, Challenge, CredentialStore, parse_www_authenticate
from .hosts import Endpoint, RegistryHosts

__all__ = ["Body", "RegistryAnswer", "Retriable", "RetryPolicy", "Timeouts", "Transport"]

log = logging.getLogger(__name__)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_MAX_ERROR_BODY = 64 << 10
_T = TypeVar("_T")
# what a request sends, made afresh for each send (a challenge's answer sends it again)
Body = Callable[[], bytes | AsyncIterator[bytes]]


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0  # seconds to open a connection (TLS included)
    read: float = 30.0  # seconds between two reads of an answer: a blob may take long, but never stall
    request: float = 60.0  # seconds for a whole small request (a manifest, a config, a token) or an answer's head


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries of one request in all (or, for a blob, in a row without progress)
    base_delay: float = 0.5  # seconds before the first retry, doubling each time
    max_delay: float = 8.0

    def delay(self, failures: int) -> float:
        # jittered so that many pulls failing together do not come back together
        return min(self.max_delay, self.base_delay * 2.0 ** max(0, failures - 1)) * random.uniform(0.8, 1.2)


class Retriable(Exception):
    """A failure worth another try; ``error`` is what the caller raises when its tries run out."""

    def __init__(self, error: RegistryError, delay: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.delay = delay


@dataclass(frozen=True)
class RegistryAnswer:
    """A registry's error answer: its status and the error codes and messages of its JSON body."""

    status: int
    codes: tuple[str, ...]
    text: str
    retry_after: str | None = None

    def retry_delay(self, cap: float) -> float | None:
        """Seconds the registry asked to wait (Retry-After), at most ``cap``; None if it gave no number."""
        try:
            seconds = float(self.retry_after) if self.retry_after is not None else None
        except ValueError:
            return None  # an HTTP date: the backoff decides instead
        return None if seconds is None else min(max(seconds, 0.0), cap)


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unreachable(where: str, exc: BaseException) -> Retriable:
    return Retriable(RegistryUnreachable(f"{where}: {describe(exc)}"))


@asynccontextmanager
async def deadline(seconds: float, message: str) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise Retriable(RegistryUnreachable(f"{message} did not answer within {seconds:g} s")) from None


class Transport:
    """The HTTP side of a registry client: clients per TLS setting, endpoint schemes, auth, retries."""

    def __init__(
        self,
        hosts: RegistryHosts,
        credentials: CredentialStore,
        *,
        timeouts: Timeouts,
        retry: RetryPolicy,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.hosts = hosts
        self.timeouts = timeouts
        self.retry = retry
        self._transport = transport  # tests answer requests in-process with one
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._bases: dict[Endpoint, str] = {}
        self.auth = Authenticator(credentials, self._fetch_token)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    def _client(self, host: str) -> httpx.AsyncClient:
        ca = self.hosts.ca_file(host)
        key = str(ca) if ca is not None else ""
        client = self._clients.get(key)
        if client is None:
            context = self.hosts.ssl_context(host)
            client = httpx.AsyncClient(
                verify=context if context is not None else True,
                timeout=httpx.Timeout(self.timeouts.read, connect=self.timeouts.connect),
                follow_redirects=False,  # followed here, where the scheme and the credentials are checked
                trust_env=False,  # no proxy or CA from the environment: what is configured is what happens
                headers={"User-Agent": f"dsec/{__version__}"},
                transport=self._transport,
            )
            self._clients[key] = client
        return client

    # ---- the scheme of an endpoint ----------------------------------------------------------------------

    async def base_url(self, endpoint: Endpoint) -> str:
        """``scheme://host[/prefix]`` of ``endpoint``; an endpoint allowed plain HTTP is probed, TLS first."""
        known = self._bases.get(endpoint)
        if known is not None:
            return known
        if len(endpoint.schemes) == 1:
            base = f"{endpoint.schemes[0]}://{endpoint.host}{endpoint.prefix}"
            self._bases[endpoint] = base
            return base
        failures: list[str] = []
        answered = False
        for scheme in endpoint.schemes:
            base = f"{scheme}://{endpoint.host}{endpoint.prefix}"
            over = "over TLS" if scheme == "https" else "over plain HTTP"
            try:
                async with self._client(endpoint.host).stream("GET", f"{base}/v2/") as response:
                    status, registry = response.status_code, _is_registry(response)
                    said = (await read_bounded(response, _MAX_ERROR_BODY, f"{base}/v2/"))[:120]
            except (httpx.TransportError, Retriable, RegistryError) as e:
                failures.append(f"{over}: {describe(e.error if isinstance(e, Retriable) else e)}")
                continue
            answered = True
            # a TLS server asked in plain HTTP answers 400: only a registry's own answer settles the scheme
            if scheme == "https" or status in (200, 401) or registry:
                self._bases[endpoint] = base
                return base
            failures.append(f"{over}: answered HTTP {status} {said.decode('utf-8', 'replace')!r}")
        error = RegistryUnreachable(f"cannot reach {endpoint.label()} at {endpoint.host}: {'; '.join(failures)}")
        if answered:
            raise error  # something answered that is not a registry: trying again will not change that
        raise Retriable(error)

    def check_url(self, url: httpx.URL, why: str) -> None:
        """Refuse plain HTTP to a host that is neither loopback nor named insecure."""
        host = url.netloc.decode("ascii")
        if url.scheme == "https" or (url.scheme == "http" and self.hosts.plain_http_allowed(host)):
            return
        if url.scheme != "http":
            raise RegistryError(f"{why} {url} is not an http(s) URL")
        raise RegistryError(
            f"{why} {url} is plain HTTP, but {host} is neither a loopback address nor a host named insecure"
        )

    # ---- one request ------------------------------------------------------------------------------------

    async def _send(
        self,
        endpoint: Endpoint,
        url: str,
        headers: dict[str, str],
        authorization: str | None,
        method: str = "GET",
        body: Body | None = None,
    ) -> httpx.Response:
        """``method`` ``url``; a GET or HEAD follows redirects (an upload's answer names its next URL, never
        a redirect); the Authorization header goes only to the endpoint's own host."""
        target = httpx.URL(url)
        for _ in range(_MAX_REDIRECTS + 1):
            host = target.netloc.decode("ascii")
            sent = dict(headers)
            if authorization is not None and host == endpoint.host:
                sent["Authorization"] = authorization
            client = self._client(host)
            content = body() if body is not None else None
            try:
                request = client.build_request(method, target, headers=sent, content=content)
                response = await client.send(request, stream=True)
            except httpx.TransportError as e:
                raise unreachable(f"cannot {method} {target} at {endpoint.label()}", e) from None
            location = response.headers.get("location")
            if method not in ("GET", "HEAD") or response.status_code not in _REDIRECTS or not location:
                return response
            await response.aclose()
            try:
                target = target.join(location)
            except httpx.InvalidURL:
                raise RegistryError(f"{endpoint.label()} redirected to an invalid URL {location!r}") from None
            self.check_url(target, f"{endpoint.label()} redirected to")
        raise RegistryError(f"{endpoint.label()} redirected more than {_MAX_REDIRECTS} times for {url}")

    @asynccontextmanager
    async def attempt(
        self,
        endpoint: Endpoint,
        path: str,
        *,
        scope: str,
        headers: dict[str, str],
        what: str,
        not_found: Callable[[RegistryAnswer], DsecError],
        method: str = "GET",
        body: Body | None = None,
        seconds: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """One try of ``method`` ``path`` on ``endpoint`` (``path`` may be a full URL an upload was given),
        authorised (answering one challenge; ``body`` makes the request's content afresh for each send):
        yields a 2xx answer whose body is not read yet. Retriable for what another try may fix; the right
        error otherwise. ``seconds``: the deadline of the request's head, if not the small-request one."""
        limit = self.timeouts.request if seconds is None else seconds
        async with deadline(limit, f"{endpoint.label()} ({endpoint.host})"):
            url = path if path.startswith(("http://", "https://")) else await self.base_url(endpoint) + path
            authorization = await self.auth.authorization(endpoint, scope)
            response = await self._send(endpoint, url, headers, authorization, method, body)
            if response.status_code == 401:
                challenges = _challenges(response, endpoint)
                await response.aclose()
                authorization = await self.auth.answer(endpoint, scope, challenges, authorization)
                response = await self._send(endpoint, url, headers, authorization, method, body)
        try:
            if response.status_code == 401:
                raise RegistryAuthFailed(self.auth.refused(endpoint, scope))
            if not 200 <= response.status_code < 300:
                answer = await _answer(response)
                raise self._failure(answer, endpoint, scope, what, not_found)
            yield response
        finally:
            await response.aclose()

    def _failure(
        self,
        answer: RegistryAnswer,
        endpoint: Endpoint,
        scope: str,
        what: str,
        not_found: Callable[[RegistryAnswer], DsecError],
    ) -> BaseException:
        said = f": {answer.text}" if answer.text else ""
        if answer.status == 404:
            return not_found(answer)
        if answer.status == 403:
            return RegistryAuthFailed(self.auth.refused(endpoint, scope) + said)
        error = RegistryError(f"{endpoint.label()} answered HTTP {answer.status} for {what}{said}")
        if answer.status == 429:
            return Retriable(
                RegistryError(f"{endpoint.label()} is rate-limiting requests for {what}{said}"),
                delay=answer.retry_delay(self.retry.max_delay),
            )
        if answer.status in _RETRY_STATUSES:
            return Retriable(error)
        return error

    # ---- retried requests -------------------------------------------------------------------------------

    async def retrying(self, op: Callable[[], Awaitable[_T]], what: str) -> _T:
        """Run ``op`` until it succeeds, fails for good, or the policy's tries run out."""
        failures = 0
        while True:
            try:
                return await op()
            except Retriable as r:
                error, delay = r.error, r.delay
            failures += 1
            if failures >= self.retry.attempts:
                raise error
            wait = delay if delay is not None else self.retry.delay(failures)
            log.info("retrying %s in %.1f s (%d of %d): %s", what, wait, failures, self.retry.attempts - 1, error)
            await asyncio.sleep(wait)

    async def fetch(
        self,
        endpoint: Endpoint,
        path: str,
        *,
        scope: str,
        headers: dict[str, str],
        what: str,
        limit: int,
        not_found: Callable[[RegistryAnswer], DsecError],
    ) -> tuple[bytes, httpx.Headers]:
        """A small document (at most ``limit`` bytes) whole, with its answer's headers; retried."""

        async def once() -> tuple[bytes, httpx.Headers]:
            async with self.attempt(endpoint, path, scope=scope, headers=headers, what=what, not_found=not_found) as r:
                async with deadline(self.timeouts.request, f"{endpoint.label()} ({endpoint.host})"):
                    return await read_bounded(r, limit, f"{what} from {endpoint.label()}"), r.headers

        return await self.retrying(once, f"{what} from {endpoint.label()}")

    async def _fetch_token(
        self, realm: str, query: list[tuple[str, str]], authorization: str | None
    ) -> tuple[int, bytes]:
        try:
            url = httpx.URL(realm).copy_merge_params(httpx.QueryParams(tuple(query)))
        except httpx.InvalidURL:
            raise RegistryError(f"invalid token realm {realm!r}") from None
        self.check_url(url, "token realm")  # credentials never go to a plain-HTTP host that is not local or chosen

        async def once() -> tuple[int, bytes]:
            client = self._client(url.netloc.decode("ascii"))
            headers = {"Authorization": authorization} if authorization else {}
            async with deadline(self.timeouts.request, f"token service {realm}"):
                try:
                    async with client.stream("GET", url, headers=headers) as response:
                        if response.status_code in _RETRY_STATUSES:
                            raise Retriable(
                                RegistryError(f"token service {realm} answered HTTP {response.status_code}")
                            )
                        return response.status_code, await read_bounded(
                            response, MAX_TOKEN_ANSWER, f"token from {realm}"
                        )
                except httpx.TransportError as e:
                    raise unreachable(f"cannot reach token service {realm}", e) from None

        return await self.retrying(once, f"token from {realm}")


async def _answer(response: httpx.Response) -> RegistryAnswer:
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > _MAX_ERROR_BODY:
                break
    except httpx.TransportError:
        pass  # the status says enough
    codes: list[str] = []
    texts: list[str] = []
    try:
        errors = json.loads(body).get("errors") or []
        for e in errors[:5]:
            codes.append(str(e.get("code", "")))
            texts.append(f"{e.get('code', '')} ({e.get('message', '')})".strip())
    except (ValueError, AttributeError, TypeError):
        text = body[:200].decode("utf-8", "replace").strip()
        texts = [text] if text else []
    return RegistryAnswer(response.status_code, tuple(codes), "; ".join(texts), response.headers.get("retry-after"))


def _challenges(response: httpx.Response, endpoint: Endpoint) -> list[Challenge]:
    try:
        return parse_www_authenticate(response.headers.get_list("www-authenticate"))
    except ValueError as e:
        raise RegistryError(f"{endpoint.label()} sent a malformed WWW-Authenticate header: {e}") from None


def _is_registry(response: httpx.Response) -> bool:
    return "docker-distribution-api-version" in response.headers


async def read_bounded(response: httpx.Response, limit: int, what: str) -> bytes:
    """The whole body, refused once it passes ``limit`` (before reading, when the length is declared)."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RegistryError(f"{what} is {int(declared)} bytes, over the limit of {limit}")
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise RegistryError(f"{what} is over the limit of {limit} bytes")
            parts.append(chunk)
    except httpx.TransportError as e:
        raise unreachable(f"reading {what}", e) from None
    return b"".join(parts)
