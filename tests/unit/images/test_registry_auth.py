"""Registry authentication: WWW-Authenticate challenges, credentials from a Docker config.json or a mapping,
and the bearer-token cache (dsec.images.registry.auth)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsec.errors import InvalidRequest, RegistryAuthFailed, RegistryError
from dsec.images.registry import auth as auth_module
from dsec.images.registry.auth import (
    Authenticator,
    Challenge,
    Credentials,
    CredentialStore,
    parse_www_authenticate,
)
from dsec.images.registry.hosts import Endpoint

# ---- WWW-Authenticate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (
            ['Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:a/b:pull"'],
            [
                Challenge(
                    "bearer",
                    {
                        "realm": "https://auth.docker.io/token",
                        "service": "registry.docker.io",
                        "scope": "repository:a/b:pull",
                    },
                )
            ],
        ),
        # a comma inside a quoted scope, spaces around '=' and ',', a scheme in another case
        (
            ['BEARER realm = "https://t/x" , scope="repository:a:pull,push"'],
            [Challenge("bearer", {"realm": "https://t/x", "scope": "repository:a:pull,push"})],
        ),
        (['Basic realm="Registry Realm"'], [Challenge("basic", {"realm": "Registry Realm"})]),
        # unquoted values, and escapes inside quotes
        (['Basic realm=simple, charset="UTF-8"'], [Challenge("basic", {"realm": "simple", "charset": "UTF-8"})]),
        ([r'Basic realm="say \"hi\" \\ there"'], [Challenge("basic", {"realm": 'say "hi" \\ there'})]),
        # several challenges in one header, and over several headers
        (
            ['Basic realm="a", Bearer realm="https://t",service="s"', "Negotiate abc123=="],
            [
                Challenge("basic", {"realm": "a"}),
                Challenge("bearer", {"realm": "https://t", "service": "s"}),
                Challenge("negotiate", {"": "abc123=="}),
            ],
        ),
        (["Bearer"], [Challenge("bearer", {})]),
        # error parameters the registry adds after a token was refused
        (
            ['Bearer realm="https://t",error="insufficient_scope",scope="repository:x:pull"'],
            [Challenge("bearer", {"realm": "https://t", "error": "insufficient_scope", "scope": "repository:x:pull"})],
        ),
        ([], []),
    ],
)
def test_www_authenticate(headers: list[str], expected: list[Challenge]) -> None:
    assert parse_www_authenticate(headers) == expected


@pytest.mark.parametrize("header", ['="x"', 'Bearer realm="unterminated', "@@@"])
def test_malformed_www_authenticate(header: str) -> None:
    with pytest.raises(ValueError):
        parse_www_authenticate([header])


# ---- credentials ----------------------------------------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _config(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_docker_config_auths(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        {
            "auths": {
                "https://index.docker.io/v1/": {"auth": _b64("hubuser:hub:pass")},  # a ':' in the password
                "registry.example:5000": {"username": "u", "password": "p"},
                "http://plain.example/v2/": {"auth": _b64("pu:pp")},
                "Mixed.Case.Example": {"auth": _b64("m:n")},
                "empty.example": {},
            }
        },
    )
    store = CredentialStore.from_docker_config(path)
    hub = store.lookup("docker.io")
    assert hub is not None and (hub.username, hub.password) == ("hubuser", "hub:pass")
    assert store.lookup("registry-1.docker.io") == hub
    assert store.lookup("index.docker.io") == hub
    example = store.lookup("registry.example:5000")
    assert example is not None and (example.username, example.password) == ("u", "p")
    assert store.lookup("registry.example") is None  # another port is another registry
    assert store.lookup("plain.example") is not None
    assert store.lookup("mixed.case.example") is not None
    assert store.lookup("empty.example") is None
    assert f"Docker config {path}" in hub.source
    assert "hub:pass" not in repr(hub)  # the secret never shows in a repr (logs, errors)


def test_docker_config_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _config(tmp_path, {"auths": {"r.example": {"auth": _b64("a:b")}}})
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert CredentialStore.from_docker_config().lookup("r.example") is not None
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "absent"))
    assert CredentialStore.from_docker_config().lookup("r.example") is None  # no file: no credentials


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("[]", "is not a JSON object"),
        ("{", "cannot read Docker config"),
        ('{"auths": []}', "'auths'"),
        ('{"auths": {"r": "x"}}', "is not an object"),
        ('{"auths": {"r": {"auth": "***"}}}', "not base64 of user:password"),
        ('{"auths": {"r": {"auth": "' + _b64("nocolon") + '"}}}', "not user:password"),
        ('{"credHelpers": {"r": 5}}', "'credHelpers'"),
    ],
)
def test_bad_docker_configs(tmp_path: Path, data: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(data)
    with pytest.raises(InvalidRequest) as info:
        CredentialStore.from_docker_config(path)
    assert message in str(info.value)


def test_credential_helpers_are_reported_not_run(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        {
            "auths": {"has.example": {"auth": _b64("a:b")}, "oauth.example": {"identitytoken": "xyz"}},
            "credHelpers": {"ecr.example": "ecr-login"},
            "credsStore": "desktop",
        },
    )
    store = CredentialStore.from_docker_config(path)
    assert store.lookup("ecr.example") is None
    assert "docker-credential-ecr-login" in (store.unusable("ecr.example") or "")
    assert "identity token" in (store.unusable("oauth.example") or "")
    assert "docker-credential-desktop" in (store.unusable("other.example") or "")
    assert store.unusable("has.example") is None  # it has credentials dsec can use


def test_explicit_mapping_overrides_the_config(tmp_path: Path) -> None:
    path = _config(tmp_path, {"auths": {"r.example": {"auth": _b64("old:x")}, "s.example": {"auth": _b64("s:y")}}})
    explicit = CredentialStore.from_mapping(
        {"r.example": "new:pw:with:colons", "t.example": ("tu", "tp"), "docker.io": Credentials("h", "p", "here")}
    )
    store = CredentialStore.from_docker_config(path).merged(explicit)
    r = store.lookup("r.example")
    assert r is not None and (r.username, r.password, r.source) == ("new", "pw:with:colons", "--registry-auth")
    assert store.lookup("s.example") is not None
    assert store.lookup("t.example") == Credentials("tu", "tp", "--registry-auth")
    assert store.lookup("index.docker.io") == Credentials("h", "p", "here")
    with pytest.raises(InvalidRequest, match="not user:password"):
        CredentialStore.from_mapping({"x": "nopassword"})


# ---- challenges and the token cache -------------------------------------------------------------------


class FakeTokens:
    """A token service: hands out numbered tokens and records what it was asked."""

    def __init__(self, status: int = 200, expires_in: object = 300) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]], str | None]] = []
        self.status = status
        self.expires_in = expires_in

    async def __call__(self, realm: str, query: list[tuple[str, str]], authorization: str | None) -> tuple[int, bytes]:
        self.calls.append((realm, query, authorization))
        body = {"token": f"t{len(self.calls)}", "expires_in": self.expires_in}
        return self.status, json.dumps(body).encode()


EP = Endpoint("r.example", "r.example", ("https",))
BEARER = [Challenge("bearer", {"realm": "https://auth.example/token", "service": "r.example"})]


async def test_bearer_tokens_are_fetched_once_per_scope_and_sent_up_front() -> None:
    tokens = FakeTokens()
    creds = CredentialStore.from_mapping({"r.example": "u:p"})
    auth = Authenticator(creds, tokens)
    assert await auth.authorization(EP, "repository:a:pull") is None  # nothing known about the host yet
    header = await auth.answer(EP, "repository:a:pull", BEARER, None)
    assert header == "Bearer t1"
    realm, query, basic = tokens.calls[0]
    assert realm == "https://auth.example/token"
    assert query == [("service", "r.example"), ("scope", "repository:a:pull")]
    assert basic == Credentials("u", "p").basic()
    # the host is now known to want tokens: the same scope reuses the token, another scope gets its own
    assert await auth.authorization(EP, "repository:a:pull") == "Bearer t1"
    assert await auth.authorization(EP, "repository:b:pull") == "Bearer t2"
    assert len(tokens.calls) == 2


async def test_a_refused_token_is_replaced_and_an_expired_one_renewed(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = FakeTokens(expires_in=60)
    auth = Authenticator(CredentialStore(), tokens)
    first = await auth.answer(EP, "repository:a:pull", BEARER, None)
    again = await auth.answer(EP, "repository:a:pull", BEARER, first)  # the registry said 401 to it
    assert (first, again) == ("Bearer t1", "Bearer t2")
    assert tokens.calls[0][2] is None  # anonymous: no Basic header to the token service
    later = SimpleNamespace(monotonic=lambda: time.monotonic() + 56)  # 4 s before expiry: within the margin
    monkeypatch.setattr(auth_module, "time", later)  # the module's clock only, not the event loop's
    assert await auth.authorization(EP, "repository:a:pull") == "Bearer t3"


async def test_the_challenge_scope_is_asked_for_too() -> None:
    tokens = FakeTokens()
    auth = Authenticator(CredentialStore(), tokens)
    challenge = [Challenge("bearer", {"realm": "https://t", "scope": "repository:a:pull,push"})]
    await auth.answer(EP, "repository:a:pull", challenge, None)
    assert tokens.calls[0][1] == [("scope", "repository:a:pull"), ("scope", "repository:a:pull,push")]


async def test_a_challenge_scope_is_not_carried_to_other_requests() -> None:
    tokens = FakeTokens()
    auth = Authenticator(CredentialStore(), tokens)
    challenge = [Challenge("bearer", {"realm": "https://t", "scope": "repository:a:pull"})]
    await auth.answer(EP, "repository:a:pull", challenge, None)
    await auth.authorization(EP, "repository:b:pull")
    assert [c[1] for c in tokens.calls] == [[("scope", "repository:a:pull")], [("scope", "repository:b:pull")]]


async def test_token_service_refusal_names_the_registry_and_the_user() -> None:
    auth = Authenticator(CredentialStore.from_mapping({"r.example": "bob:wrong"}), FakeTokens(status=401))
    with pytest.raises(RegistryAuthFailed) as info:
        await auth.answer(EP, "repository:a:pull", BEARER, None)
    message = str(info.value)
    assert "registry r.example" in message and "'bob'" in message and "wrong" not in message


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"nope", "did not answer JSON"), (b'{"expires_in": 5}', "answered no token"), (b"[]", "JSON object")],
)
async def test_bad_token_answers(body: bytes, message: str) -> None:
    async def fetch(realm: str, query: list[tuple[str, str]], authorization: str | None) -> tuple[int, bytes]:
        return 200, body

    with pytest.raises(RegistryError, match=message):
        await Authenticator(CredentialStore(), fetch).answer(EP, "repository:a:pull", BEARER, None)


async def test_basic_challenges() -> None:
    basic = [Challenge("basic", {"realm": "x"})]
    anonymous = Authenticator(CredentialStore(), FakeTokens())
    with pytest.raises(RegistryAuthFailed, match=r"requires credentials and none are configured for r\.example"):
        await anonymous.answer(EP, "repository:a:pull", basic, None)
    creds = CredentialStore.from_mapping({"r.example": "u:p"})
    auth = Authenticator(creds, FakeTokens())
    header = await auth.answer(EP, "repository:a:pull", basic, None)
    assert header == Credentials("u", "p").basic()
    assert await auth.authorization(EP, "repository:other:pull") == header  # sent up front from now on
    with pytest.raises(RegistryAuthFailed, match="refused access to a for user 'u'"):
        await auth.answer(EP, "repository:a:pull", basic, header)  # the same credentials, refused again


async def test_unsupported_schemes_and_missing_realm() -> None:
    auth = Authenticator(CredentialStore(), FakeTokens())
    with pytest.raises(RegistryAuthFailed, match="negotiate"):
        await auth.answer(EP, "repository:a:pull", [Challenge("negotiate", {})], None)
    with pytest.raises(RegistryError, match="no realm"):
        await auth.answer(EP, "repository:a:pull", [Challenge("bearer", {})], None)


async def test_a_helper_only_host_says_so_when_credentials_are_needed(tmp_path: Path) -> None:
    path = _config(tmp_path, {"credHelpers": {"r.example": "gcloud"}})
    auth = Authenticator(CredentialStore.from_docker_config(path), FakeTokens())
    with pytest.raises(RegistryAuthFailed) as info:
        await auth.answer(EP, "repository:a:pull", [Challenge("basic", {})], None)
    assert "docker-credential-gcloud" in str(info.value) and "dsec does not use" in str(info.value)
