"""Which sandbox port a request on the E2B listener names (E2B's get_host hosts and routing headers),
the sandbox domain option, and the traffic access token."""

from __future__ import annotations

import pytest

from dsec.e2b.auth import EnvdTokens
from dsec.e2b.hosts import META_MASK_HOST, check_domain, check_mask, envd_sandbox, masked_host, sandbox_port
from dsec.errors import InvalidRequest

DOMAIN = "localhost:49999"


def _h(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]


@pytest.mark.parametrize(
    ("headers", "where"),
    [
        (_h(host="8000-sb-0123456789ab.localhost:49999"), ("sb-0123456789ab", 8000)),
        (_h(host="8000-sb-0123456789ab.LOCALHOST:49999"), ("sb-0123456789ab", 8000)),  # names ignore case
        (_h(host="49983-sb-0123456789ab.localhost:49999"), None),  # envd's port: the API's own calls
        (_h(host="127.0.0.1:49999"), None),  # the control and envd APIs
        (_h(host="8000-sb-1.example.com"), None),  # another domain
        (_h(host="8000-sb-1.localhost:4999"), None),
        (_h(host="x-sb-1.localhost:49999"), None),
        (_h(host="127.0.0.1:49999", e2b_sandbox_id="sb-1", e2b_sandbox_port="3000"), ("sb-1", 3000)),
        (_h(host="127.0.0.1:49999", e2b_sandbox_id="sb-1", e2b_sandbox_port="49983"), None),  # envd
        (_h(host="127.0.0.1:49999", e2b_sandbox_port="3000"), None),  # names no sandbox
    ],
)
def test_a_request_names_a_sandbox_port_by_host_or_by_e2bs_headers(
    headers: list[tuple[bytes, bytes]], where: tuple[str, int] | None
) -> None:
    assert sandbox_port(headers, DOMAIN) == where


def test_without_a_domain_only_the_headers_route() -> None:
    assert sandbox_port(_h(host="8000-sb-1.localhost:49999"), None) is None
    assert sandbox_port(_h(e2b_sandbox_id="sb-1", e2b_sandbox_port="8000"), None) == ("sb-1", 8000)


@pytest.mark.parametrize(
    "headers",
    [
        _h(host="0-sb-1.localhost:49999"),
        _h(host="70000-sb-1.localhost:49999"),
        _h(e2b_sandbox_id="sb-1", e2b_sandbox_port="http"),
        _h(e2b_sandbox_id="sb-1", e2b_sandbox_port="65536"),
    ],
)
def test_a_port_out_of_range_is_refused(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(InvalidRequest):
        sandbox_port(headers, DOMAIN)


def test_the_domain_option() -> None:
    assert check_domain(None) is None
    assert check_domain("Sandboxes.Example.com") == "sandboxes.example.com"
    assert check_domain("localhost:49999") == "localhost:49999"
    for bad in ("", "http://x.com", "x.com/path", "x..com", "x.com:0", "x.com:99999", "a b.com", "*.x.com"):
        with pytest.raises(InvalidRequest):
            check_domain(bad)


def test_the_traffic_token_opens_one_sandbox_and_is_not_the_envd_token() -> None:
    tokens = EnvdTokens(b"k" * 32)
    token = tokens.traffic_token("sb-1")
    assert tokens.check_traffic("sb-1", token)
    assert not tokens.check_traffic("sb-2", token)
    assert not tokens.check_traffic("sb-1", "")
    assert not tokens.check_traffic("sb-1", tokens.token("sb-1"))  # the envd token opens no port
    assert not tokens.check("sb-1", token)  # nor the traffic token envd
    assert EnvdTokens(b"j" * 32).traffic_token("sb-1") != token  # the daemon's key makes it


def test_mask_request_host() -> None:
    labels = {META_MASK_HOST: "app.example.test:${PORT}"}
    assert masked_host(labels, 8080) == "app.example.test:8080"
    assert masked_host({META_MASK_HOST: "plain.test"}, 8080) == "plain.test"
    assert masked_host({}, 8080) is None
    for good in ("custom-host.example.com:${PORT}", "a.b:443", "localhost"):
        assert check_mask(good) == good
    for bad in ("a b", "host:${HOST}", "host/evil", "h\r\nX-Injected: 1", "x" * 300, "", "host:99999999"):
        with pytest.raises(InvalidRequest, match="maskRequestHost"):
            check_mask(bad)


def test_an_envd_call_at_its_sandboxs_own_host_names_the_sandbox() -> None:
    assert envd_sandbox(_h(host="49983-sb-0123456789ab.localhost:49999"), DOMAIN) == "sb-0123456789ab"
    assert envd_sandbox(_h(host="49983-SB-1.LOCALHOST:49999"), DOMAIN) == "sb-1"
    for host in ("8000-sb-1.localhost:49999", "49983-sb-1.example.com", "49983-.localhost:49999", "127.0.0.1:49999"):
        assert envd_sandbox(_h(host=host), DOMAIN) is None, host
    assert envd_sandbox(_h(host="49983-a.b.localhost:49999"), DOMAIN) is None  # an id holds no dot
    assert envd_sandbox(_h(host="49983-sb-1.localhost:49999"), None) is None  # no domain: headers only
