from __future__ import annotations

import httpx
import pytest

import dsec


def _raw(daemon: object) -> httpx.Client:
    url = daemon.url  # type: ignore[attr-defined]
    token = daemon.token  # type: ignore[attr-defined]
    transport = httpx.HTTPTransport(uds=url.removeprefix("unix://"))
    return httpx.Client(transport=transport, base_url="http://dsec", headers={"authorization": f"Bearer {token}"})


def test_unknown_image(daemon: object) -> None:
    with pytest.raises(dsec.ImageNotFound):
        dsec.Sandbox.create(image="nobody/nothing:1")
    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(image="Bad Name!")


@pytest.mark.parametrize("timeout", [-1, 0, 10**12])
def test_absurd_ttl(daemon: object, timeout: float) -> None:
    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(image="dsec/busybox", timeout=timeout)


@pytest.mark.parametrize("timeout", [-5, 0, 10**9])
def test_absurd_exec_timeout(sb: dsec.Sandbox, timeout: float) -> None:
    with pytest.raises(dsec.InvalidRequest):
        sb.exec("true", timeout=timeout)


def test_unknown_sandbox(daemon: object) -> None:
    with pytest.raises(dsec.SandboxNotFound):
        dsec.Sandbox.connect("sb-000000000000")
    with pytest.raises(LookupError):
        dsec.Sandbox.connect("x" * 500)


def test_an_unknown_kind_is_refused_naming_the_known_ones(daemon: object) -> None:
    with pytest.raises(dsec.InvalidRequest, match="'function'") as e:
        dsec.Sandbox.create(image="dsec/busybox", kind="teapot")
    assert "container" in str(e.value) and "microvm" in str(e.value)


def test_raw_http_errors_are_4xx_with_codes(daemon: object) -> None:
    with _raw(daemon) as http:
        cases = [
            http.post("/v1/sandboxes", content=b"{not json"),
            http.post("/v1/sandboxes", json={"image": "dsec/busybox", "bogus": 1}),
            http.post("/v1/sandboxes", json={"image": "dsec/busybox", "limits": {"memory": "lots"}}),
            http.post("/v1/sandboxes", json={"image": "dsec/busybox", "kind": "teapot"}),
            http.post("/v1/sandboxes/sb-000000000000/exec", json={"cmd": "true"}),
            http.post("/v1/sandboxes/sb-000000000000/exec", json={}),
            http.get("/v1/sandboxes", params={"label": "novalue"}),
            http.get("/v1/sandboxes/sb-000000000000/files"),
        ]
        for reply in cases:
            assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)
            body = reply.json()
            assert body["error"]["code"] and body["error"]["message"], body
        unauth = http.get("/v1/sandboxes", headers={"authorization": "Bearer wrong"})
        assert unauth.status_code == 401 and unauth.json()["error"]["code"] == "unauthorized"


def test_upload_too_large_is_refused(sb: dsec.Sandbox, daemon: object) -> None:
    """A declared body over the limit is answered 413 at once, without reading it."""
    import socket

    path = daemon.url.removeprefix("unix://")  # type: ignore[attr-defined]
    token = daemon.token  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        head = (
            f"PUT /v1/sandboxes/{sb.id}/files?path=/x HTTP/1.1\r\nHost: dsec\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {1 << 40}\r\n\r\n"
        )
        s.sendall(head.encode() + b"\0" * 4096)
        reply = b""
        while b"limit_exceeded" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b"limit_exceeded" in reply
