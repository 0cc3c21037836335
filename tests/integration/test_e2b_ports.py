"""E2B's ``sandbox.get_host(port)`` through dsec's E2B API, with the unmodified ``e2b`` SDK: a server in the
sandbox reached at the host the SDK names (``PORT-ID.DOMAIN``, here sent as the Host header to the E2B
listener, as wildcard DNS would send it) with the sandbox's traffic access token, or without one for a sandbox
made with allowPublicTraffic=true; HTTP and WebSocket."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from .port_servers import TOKEN, fetch, serve
from .wsclient import ws_talk

e2b = pytest.importorskip("e2b")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402


@pytest.fixture(scope="module")
def box(e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    made = Sandbox.create(timeout=600)
    serve(made)
    yield made
    made.kill()


def test_get_host_names_a_host_on_the_listener_that_reaches_the_port(box: Sandbox, e2b_env: dict[str, str]) -> None:
    listener = e2b_env["E2B_SANDBOX_URL"]
    host = box.get_host(8000)
    assert host == f"8000-{box.sandbox_id}.localhost:{urlsplit(listener).port}"  # the daemon's default domain
    token = box.traffic_access_token
    assert token and token != box._envd_access_token
    reply = fetch(listener, host, "/hi.txt", token)
    assert (reply.status_code, reply.text) == (200, "hello from inside\n")
    told = dict(fetch(listener, host, "/headers?x=1", token).json())
    assert told["host"] == "127.0.0.1:8000" and told["x-forwarded-host"] == host
    assert not {TOKEN, "e2b-sandbox-id", "e2b-sandbox-port", "x-forwarded-prefix"} & set(told)
    body = bytes(range(256)) * 16384  # 4 MiB, streamed through
    posted = fetch(listener, host, "/upload", token, "POST", content=body)
    assert (posted.status_code, posted.text) == (200, f"{len(body)} {hashlib.sha256(body).hexdigest()}")
    # E2B's routing headers name the same port without a host name for it
    by_headers = {"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": "8000", TOKEN: token}
    assert httpx.get(listener + "/hi.txt", headers=by_headers, timeout=30).text == "hello from inside\n"
    assert box.commands.run("echo envd still answers").stdout == "envd still answers\n"  # the SDK's own calls
    assert fetch(listener, box.get_host(8999), "/", token, patient=False).status_code == 502  # nothing listens


def test_a_port_needs_the_sandbox_s_traffic_token(box: Sandbox, e2b_env: dict[str, str]) -> None:
    listener = e2b_env["E2B_SANDBOX_URL"]
    host = box.get_host(8000)
    envd_token = box._envd_access_token
    assert envd_token is not None
    for token in (None, "", "not-the-token", envd_token):
        assert fetch(listener, host, "/hi.txt", token).status_code == 403, token
    other = host.replace(box.sandbox_id, "sb-000000000000")
    assert fetch(listener, other, "/hi.txt", box.traffic_access_token).status_code == 403  # the token is per sandbox


def test_allow_public_traffic_opens_that_sandbox_s_ports_only(box: Sandbox, e2b_env: dict[str, str]) -> None:
    """E2B's allowPublicTraffic=true (what the SDK sends with any network config): its ports need no token;
    every other sandbox's still do, and its own metadata cannot forge the flag."""
    listener = e2b_env["E2B_SANDBOX_URL"]
    public = Sandbox.create(timeout=120, network={"allow_public_traffic": True, "deny_out": ["192.0.2.0/24"]})
    try:
        serve(public)
        assert fetch(listener, public.get_host(8000), "/hi.txt", None).text == "hello from inside\n"
        assert fetch(listener, box.get_host(8000), "/hi.txt", None).status_code == 403
    finally:
        public.kill()
    assert fetch(listener, public.get_host(8000), "/hi.txt", None, patient=False).status_code == 403  # gone: no flag
    with pytest.raises(SandboxException, match="dsec's own"):
        Sandbox.create(metadata={"dsec.e2b.public-traffic": "true"})


def test_websockets_through_get_host(box: Sandbox, e2b_env: dict[str, str]) -> None:
    listener = e2b_env["E2B_SANDBOX_URL"]
    host = box.get_host(8300)
    token = [(TOKEN.encode(), str(box.traffic_access_token).encode())]
    deadline = time.monotonic() + 30
    while True:
        chosen, answers, code = ws_talk(
            listener + "/ws?x=1", ["hello", b"\x02" * 70000], ["env.v1"], host=host, headers=token
        )
        if chosen is not None or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert (chosen, answers, code) == ("env.v1", ["/ws?x=1 hello", b"\x02" * 70000], 4001)
    assert ws_talk(listener + "/ws", ["x"], [], host=host)[1] == [403]
