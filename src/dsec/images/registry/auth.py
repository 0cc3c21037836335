"""Registry authentication: credentials, challenges, and Docker's bearer-token flow.

A registry that wants credentials answers 401 with ``WWW-Authenticate``. ``Basic`` asks for the user and
password on every request. ``Bearer realm=...,service=...,scope=...`` sends the client to a token service:
a GET on the realm with the service and the scope (``repository:org/app:pull``), Basic credentials if there
are any (none means an anonymous token), answered with a token that is then sent as ``Bearer``. Tokens are
cached per realm, service, scope and user until they expire, and after a host's first challenge the next
requests are authorised up front, which saves a 401 round trip per request.

Credentials come from an explicit mapping (``dsec serve --registry-auth`` will feed it) or from a Docker
``config.json`` (``auths.<host>.auth``, base64 of ``user:password``, or ``username`` and ``password``).
Credential helpers (``credsStore``, ``credHelpers``) are programs dsec does not run: a registry that asks
for credentials dsec only has through a helper gets an error saying so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import InvalidRequest, RegistryAuthFailed, RegistryError
from .hosts import Endpoint, host_key

__all__ = [
    "Authenticator",
    "Challenge",
    "CredentialStore",
    "Credentials",
    "TokenGrant",
    "parse_www_authenticate",
]

TOKEN_DEFAULT_LIFETIME = 60.0  # seconds, when a token service does not say (the token spec's default)
TOKEN_MARGIN = 5.0  # a token is renewed this long before it expires, so a request never carries a stale one
MAX_TOKEN_ANSWER = 1 << 20


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str = "configuration"  # where they came from, for messages: never the secret itself

    def basic(self) -> str:
        pair = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")


# ---- WWW-Authenticate --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower-case: "basic", "bearer", ...
    params: Mapping[str, str]  # parameter names lower-case


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_SCHEME = re.compile(rf"\s*({_TOKEN})(?=\s|$|,)")
_PARAM = re.compile(rf'\s*({_TOKEN})\s*=\s*(?:({_TOKEN})|"((?:[^"\\]|\\.)*)")\s*')
_TOKEN68 = re.compile(r"\s*([A-Za-z0-9._~+/-]+=*)\s*(?=,|$)")
_ESCAPE = re.compile(r"\\(.)")


def parse_www_authenticate(values: Iterable[str]) -> list[Challenge]:
    """Every challenge in the ``WWW-Authenticate`` header values (RFC 7235: a header may hold several,
    comma-separated, and a quoted value may hold commas, as a scope with ``pull,push`` does)."""
    found: list[Challenge] = []
    for value in values:
        pos = 0
        while pos < len(value):
            if value[pos] in ", \t":
                pos += 1
                continue
            m = _SCHEME.match(value, pos)
            if m is None:
                raise ValueError(f"malformed challenge at {value[pos : pos + 40]!r}")
            scheme, pos = m[1].lower(), m.end()
            params, pos = _params(value, pos)
            found.append(Challenge(scheme, params))
    return found


def _params(value: str, pos: int) -> tuple[dict[str, str], int]:
    params: dict[str, str] = {}
    token68 = _TOKEN68.match(value, pos)
    if token68 is not None and _PARAM.match(value, pos) is None:
        return {"": token68[1]}, token68.end()
    while pos < len(value):
        m = _PARAM.match(value, pos)
        if m is None:
            break  # the next challenge's scheme
        name = m[1].lower()
        params[name] = m[2] if m[2] is not None else _ESCAPE.sub(r"\1", m[3])
        pos = m.end()
        if pos < len(value) and value[pos] == ",":
            pos += 1
    return params, pos


# ---- credentials -------------------------------------------------------------------------------------


def _config_key(key: str) -> str:
    """A config.json ``auths`` key (``https://index.docker.io/v1/``, ``http://host:5000/v2``) as a host."""
    key = key.strip()
    if "://" in key:
        key = key.split("://", 1)[1]
    return host_key(key.split("/", 1)[0])


class CredentialStore:
    """Credentials per registry host, and what a Docker config offers instead that dsec cannot use (a
    credential helper, an identity token), so that an authentication error can say so."""

    def __init__(
        self,
        entries: Mapping[str, Credentials] | None = None,
        *,
        unusable: Mapping[str, str] | None = None,
        unusable_default: str | None = None,
    ) -> None:
        self._entries = {host_key(k): v for k, v in (entries or {}).items()}
        self._unusable = {host_key(k): v for k, v in (unusable or {}).items()}
        self._unusable_default = unusable_default

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, str | tuple[str, str] | Credentials], source: str = "--registry-auth"
    ) -> CredentialStore:
        """``{host: "user:password"}`` (or a pair, or Credentials)."""
        entries: dict[str, Credentials] = {}
        for host, value in mapping.items():
            if isinstance(value, Credentials):
                entries[host] = value
                continue
            user, password = value if isinstance(value, tuple) else _split_pair(value, f"{source} for {host}")
            entries[host] = Credentials(user, password, source)
        return cls(entries)

    @classmethod
    def from_docker_config(cls, path: Path | None = None) -> CredentialStore:
        """Read a Docker ``config.json`` (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``);
        a missing file holds no credentials, an unreadable or malformed one is an error."""
        if path is None:
            base = os.environ.get("DOCKER_CONFIG")
            path = Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidRequest(f"cannot read Docker config {path}: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequest(f"Docker config {path} is not a JSON object")
        source = f"Docker config {path}"
        entries: dict[str, Credentials] = {}
        unusable: dict[str, str] = {}
        auths = data.get("auths", {}) if data.get("auths") is not None else {}
        if not isinstance(auths, dict):
            raise InvalidRequest(f"'auths' in {source} is not an object")
        for key, entry in auths.items():
            where = f"{source}, auths[{key!r}]"
            creds = _config_entry(entry, where)
            if creds is not None:
                entries[_config_key(key)] = creds
            elif isinstance(entry, dict) and entry.get("identitytoken"):
                unusable[_config_key(key)] = f"only an identity token (OAuth) in {where}"
        helpers = data.get("credHelpers", {}) if data.get("credHelpers") is not None else {}
        if not isinstance(helpers, dict) or not all(isinstance(v, str) for v in helpers.values()):
            raise InvalidRequest(f"'credHelpers' in {source} is not an object of helper names")
        for key, helper in helpers.items():
            unusable[_config_key(key)] = f"credential helper docker-credential-{helper} in {source}"
        store = data.get("credsStore")
        default = (
            f"credential store docker-credential-{store} in {source}" if isinstance(store, str) and store else None
        )
        return cls(entries, unusable=unusable, unusable_default=default)

    def merged(self, override: CredentialStore) -> CredentialStore:
        """These credentials with ``override``'s taking precedence host by host."""
        return CredentialStore(
            {**self._entries, **override._entries},
            unusable={**self._unusable, **override._unusable},
            unusable_default=override._unusable_default or self._unusable_default,
        )

    def lookup(self, host: str) -> Credentials | None:
        return self._entries.get(host_key(host))

    def unusable(self, host: str) -> str | None:
        """What a Docker config offers for ``host`` that dsec cannot use (a credential helper it does not run,
        an identity token), if that is all it offers."""
        if host_key(host) in self._entries:
            return None
        return self._unusable.get(host_key(host)) or self._unusable_default


def _split_pair(text: str, where: str) -> tuple[str, str]:
    user, colon, password = text.partition(":")
    if not colon or not user:
        raise InvalidRequest(f"credentials in {where} are not user:password")
    return user, password


def _config_entry(entry: object, where: str) -> Credentials | None:
    if not isinstance(entry, dict):
        raise InvalidRequest(f"{where} is not an object")
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            decoded = base64.b64decode(auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise InvalidRequest(f"{where}: 'auth' is not base64 of user:password") from None
        user, password = _split_pair(decoded, where)
        return Credentials(user, password, where)
    username, secret = entry.get("username"), entry.get("password")
    if isinstance(username, str) and username and isinstance(secret, str):
        return Credentials(username, secret, where)
    # an entry with only an identity token (an OAuth refresh token) or nothing: no credentials dsec can use
    return None


# ---- tokens and challenges ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenGrant:
    token: str = field(repr=False)
    expires: float  # time.monotonic() after which it is not used


# fetch a token: (realm, query parameters, Authorization header or None) → (HTTP status, body)
TokenFetcher = Callable[[str, list[tuple[str, str]], str | None], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True)
class _Realm:
    url: str
    service: str


class Authenticator:
    """Answers challenges and authorises requests; one per client, shared by its concurrent requests."""

    def __init__(self, credentials: CredentialStore, fetch_token: TokenFetcher) -> None:
        self._credentials = credentials
        self._fetch = fetch_token
        self._schemes: dict[str, Challenge] = {}  # per endpoint host: the last challenge it gave
        self._tokens: dict[tuple[str, str, str, str], TokenGrant] = {}
        self._locks: dict[tuple[str, str, str, str], asyncio.Lock] = {}

    async def authorization(self, endpoint: Endpoint, scope: str) -> str | None:
        """The Authorization header to send up front, from what ``endpoint``'s host asked for before."""
        challenge = self._schemes.get(endpoint.host)
        if challenge is None:
            return None
        creds = self._credentials.lookup(endpoint.credentials_key)
        if challenge.scheme == "basic":
            return creds.basic() if creds is not None else None
        return await self._bearer(endpoint, challenge, scope, creds)

    async def answer(self, endpoint: Endpoint, scope: str, challenges: list[Challenge], sent: str | None) -> str:
        """The Authorization header to retry with after a 401 carrying ``challenges``, having sent ``sent``;
        RegistryAuthFailed when there is nothing better to send."""
        chosen = _choose(challenges, endpoint)
        # remembered for the host without its scope, which named the resource of that one request
        self._schemes[endpoint.host] = Challenge(
            chosen.scheme, {k: v for k, v in chosen.params.items() if k != "scope"}
        )
        creds = self._credentials.lookup(endpoint.credentials_key)
        if chosen.scheme == "basic":
            if creds is None:
                raise RegistryAuthFailed(self._no_credentials(endpoint))
            if sent == creds.basic():
                raise RegistryAuthFailed(self.refused(endpoint, scope, creds))
            return creds.basic()
        if sent is not None and sent.startswith("Bearer "):
            self._forget(sent)  # refused (expired, revoked, too narrow): the next one is fetched afresh
        return await self._bearer(endpoint, chosen, scope, creds)

    def refused(self, endpoint: Endpoint, scope: str, creds: Credentials | None = None) -> str:
        """Why a request still got 401 or 403 after authorising: whose credentials, for what."""
        creds = creds if creds is not None else self._credentials.lookup(endpoint.credentials_key)
        what = scope.split(":")[1] if scope.count(":") >= 2 else scope
        if creds is None:
            return (
                f"{endpoint.label()} refused anonymous access to {what}: the repository may not exist, or it needs "
                f"credentials{self._helper_note(endpoint)}"
            )
        return (
            f"{endpoint.label()} refused access to {what} for user {creds.username!r} (credentials from {creds.source})"
        )

    def _no_credentials(self, endpoint: Endpoint) -> str:
        return f"{endpoint.label()} requires credentials and none are configured for {endpoint.credentials_key}" + (
            self._helper_note(endpoint)
        )

    def _helper_note(self, endpoint: Endpoint) -> str:
        unusable = self._credentials.unusable(endpoint.credentials_key)
        if unusable is None:
            return ""
        return (
            f"; for it there is {unusable}, which dsec does not use: give user and password in the Docker "
            "config's auths or with --registry-auth"
        )

    def _prune(self) -> None:
        # a node pulls from thousands of repositories over its life: expired tokens go, and idle locks
        now = time.monotonic()
        for key in [k for k, g in self._tokens.items() if g.expires <= now]:
            del self._tokens[key]
        for key in [k for k, lock in self._locks.items() if k not in self._tokens and not lock.locked()]:
            del self._locks[key]

    def _forget(self, header: str) -> None:
        token = header.removeprefix("Bearer ")
        for key, grant in list(self._tokens.items()):
            if grant.token == token:
                del self._tokens[key]

    async def _bearer(self, endpoint: Endpoint, challenge: Challenge, scope: str, creds: Credentials | None) -> str:
        realm = _Realm(challenge.params.get("realm", ""), challenge.params.get("service", ""))
        if not realm.url:
            raise RegistryError(f"{endpoint.label()} asked for a bearer token without saying where (no realm)")
        scopes = _scopes(scope, challenge.params.get("scope", ""))
        key = (realm.url, realm.service, " ".join(scopes), creds.username if creds else "")
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent requests for one scope share one token fetch
            grant = self._tokens.get(key)
            if grant is None or grant.expires <= time.monotonic():
                grant = await self._fetch_grant(endpoint, realm, scopes, creds)
                self._prune()
                self._tokens[key] = grant
        return f"Bearer {grant.token}"

    async def _fetch_grant(
        self, endpoint: Endpoint, realm: _Realm, scopes: list[str], creds: Credentials | None
    ) -> TokenGrant:
        query = [("service", realm.service)] if realm.service else []
        query += [("scope", s) for s in scopes]
        started = time.monotonic()
        status, body = await self._fetch(realm.url, query, creds.basic() if creds else None)
        if status in (401, 403):
            who = f"the credentials of user {creds.username!r} ({creds.source})" if creds else "anonymous access"
            raise RegistryAuthFailed(
                f"the token service {realm.url} of {endpoint.label()} refused {who}{self._helper_note(endpoint)}"
            )
        if status != 200:
            raise RegistryError(f"the token service {realm.url} of {endpoint.label()} answered HTTP {status}")
        return _grant(body, started, f"the token service {realm.url} of {endpoint.label()}")


def _choose(challenges: list[Challenge], endpoint: Endpoint) -> Challenge:
    by_scheme = {c.scheme: c for c in challenges}
    for scheme in ("bearer", "basic"):
        if scheme in by_scheme:
            return by_scheme[scheme]
    offered = ", ".join(sorted(by_scheme)) or "no challenge"
    raise RegistryAuthFailed(
        f"{endpoint.label()} asks for authentication dsec does not support ({offered}; dsec speaks Basic and Bearer)"
    )


def _scopes(ours: str, theirs: str) -> list[str]:
    # ours names what this request needs; a registry may ask for more (space-separated scopes)
    found = [ours] if ours else []
    for s in theirs.split():
        if s not in found:
            found.append(s)
    return found


def _grant(body: bytes, started: float, where: str) -> TokenGrant:
    if len(body) > MAX_TOKEN_ANSWER:
        raise RegistryError(f"{where} answered {len(body)} bytes, more than a token")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RegistryError(f"{where} did not answer JSON") from None
    if not isinstance(data, dict):
        raise RegistryError(f"{where} did not answer a JSON object")
    token = data.get("token") or data.get("access_token")
    if not isinstance(token, str) or not token:
        raise RegistryError(f"{where} answered no token")
    lifetime = data.get("expires_in", TOKEN_DEFAULT_LIFETIME)
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = TOKEN_DEFAULT_LIFETIME
    # counted from when the request was sent: the service's clock (issued_at) may not agree with ours
    return TokenGrant(token, started + float(lifetime) - TOKEN_MARGIN)
