"""Exposed ports (issue 22, item 1): a server on a sandbox's loopback reached through the daemon's port
proxy with the port's own secret, never the API token; gone with the sandbox or when unexposed."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import dsec

from .conftest import Daemon, free_port, require_kind, scratch_dir, shut_down, start_daemon
from .wsclient import ws_talk

# python3's http.server, plus a POST that reads its body and answers with its length and digest (the
# stock server answers POST with 501 without reading the body, and a TCP close with unread input is a
# reset that can destroy that answer on its way: a race in the server, whatever proxy is in front)
SERVER = (
    "mkdir -p /srv/www && echo hello from inside > /srv/www/hi.txt && cd /srv/www && "
    "nohup python3 -c '"
    "import hashlib, http.server, sys\n"
    "class H(http.server.SimpleHTTPRequestHandler):\n"
    "    def do_POST(self):\n"
    '        body = self.rfile.read(int(self.headers["Content-Length"]))\n'
    '        out = ("%d %s" % (len(body), hashlib.sha256(body).hexdigest())).encode()\n'
    '        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()\n'
    "        self.wfile.write(out)\n"
    'http.server.ThreadingHTTPServer(("127.0.0.1", {port}), H).serve_forever()\n'
    "' >/tmp/http.log 2>&1 &"
)


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name: ports are reached over TCP, so this module runs a daemon
    of its own on a loopback port (the session's listens on a unix socket)."""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with scratch_dir("dsec-ports-") as workdir:
        d = start_daemon(workdir / "state", listen=f"http://127.0.0.1:{free_port()}")
        try:
            yield d
        finally:
            shut_down(d)


@pytest.fixture
def make_sandbox(daemon: Daemon) -> Iterator[Callable[..., dsec.Sandbox]]:
    made: list[dsec.Sandbox] = []

    def make(**kw: object) -> dsec.Sandbox:
        sb = dsec.Sandbox.create(client=daemon.client(), timeout=300, **kw)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.kill()


def _expose(daemon: Daemon, sb: dsec.Sandbox, port: int) -> str:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    reply = httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/ports", json={"port": port}, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return str(daemon.url + reply.json()["path"])


def _wait(url: str) -> httpx.Response:
    """The first answer that is not 502: a server just started in a sandbox (python3 under TCG, with a
    loaded host, takes seconds) is not listening yet."""
    deadline = time.monotonic() + 120
    while True:
        reply = httpx.get(url, timeout=10)
        if reply.status_code != 502 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


@pytest.mark.parametrize("kind", ["container", "function", "microvm"])
def test_a_server_inside_is_reached_through_its_exposed_port(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox], kind: str
) -> None:
    sb = make_sandbox(kind=kind)
    sb.exec(SERVER.format(port=8000))
    base = sb.expose(8000)  # the SDK's way; _expose below is the HTTP API's
    assert base.startswith(daemon.url + "/ports/") and base.endswith("/")
    assert daemon.token not in base
    reply = _wait(base + "hi.txt")
    assert (reply.status_code, reply.text) == (200, "hello from inside\n")
    body = bytes(range(256)) * 4000  # 1 MB through, both ways streamed
    posted = httpx.post(base + "upload", content=body, timeout=60)
    assert (posted.status_code, posted.text) == (200, f"{len(body)} {hashlib.sha256(body).hexdigest()}")
    assert _expose(daemon, sb, 8000) == base  # exposing again: the same address
    wrong = base.replace("/8000/", "/8001/")
    assert httpx.get(wrong + "hi.txt", timeout=10).status_code == 404
    tampered = base[:-3] + ("a" if base[-3] != "a" else "b") + base[-2:]
    assert httpx.get(tampered + "hi.txt", timeout=10).status_code == 404


def test_a_server_in_a_vm_guest_is_reached_through_its_exposed_port(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    """The vm kind (a q35 machine booting the image's own init; TCG here, so one round trip): busybox's
    httpd in the guest, reached through the guest's nc relay."""
    require_kind(daemon.client(), "vm")
    sb = make_sandbox(kind="vm", image="dsec/busybox", memory="256Mi")
    sb.exec("mkdir -p /srv/www && echo hello from the guest > /srv/www/hi.txt && httpd -p 127.0.0.1:8000 -h /srv/www")
    base = sb.expose(8000)
    reply = _wait(base + "hi.txt")
    assert (reply.status_code, reply.text) == (200, "hello from the guest\n")


def test_nothing_listening_is_a_502_and_the_address_ends_with_the_sandbox(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    sb = make_sandbox()
    base = _expose(daemon, sb, 8123)
    reply = httpx.get(base, timeout=30)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "port_unreachable"
    sb.exec(SERVER.format(port=8123))
    assert _wait(base + "hi.txt").status_code == 200
    sb.kill()
    assert httpx.get(base + "hi.txt", timeout=10).status_code == 404


def test_unexposed_ports_and_kinds_without_ports_are_refused(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    sb = make_sandbox()
    sb.exec(SERVER.format(port=8200))
    base = _expose(daemon, sb, 8200)
    assert _wait(base + "hi.txt").status_code == 200
    headers = {"Authorization": f"Bearer {daemon.token}"}
    listed = httpx.get(f"{daemon.url}/v1/sandboxes/{sb.id}/ports", headers=headers, timeout=30).json()
    assert [p["port"] for p in listed["ports"]] == [8200]
    gone = httpx.delete(f"{daemon.url}/v1/sandboxes/{sb.id}/ports/8200", headers=headers, timeout=30)
    assert gone.status_code == 204
    assert httpx.get(base + "hi.txt", timeout=10).status_code == 404
    bad = httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/ports", json={"port": 70000}, headers=headers, timeout=30)
    assert bad.status_code in (400, 422)
    anon = httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/ports", json={"port": 8200}, timeout=30)
    assert anon.status_code == 401


def test_websockets_pass_through_with_their_subprotocol_and_close_code(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    sb = make_sandbox()
    sb.files.write("/srv/ws_echo.py", (Path(__file__).parent / "ws_echo.py").read_bytes())
    sb.exec("nohup python3 /srv/ws_echo.py 8300 >/tmp/ws.log 2>&1 &")
    base = sb.expose(8300)
    deadline = time.monotonic() + 30
    while True:
        chosen, answers, code = ws_talk(base + "ws?x=1", ["hello", b"\x00\x01" * 40000], ["env.v1", "other"])
        if chosen is not None or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert chosen == "env.v1"
    assert answers == ["/ws?x=1 hello", b"\x00\x01" * 40000]  # 80 kB binary: more than one read each way
    assert code == 4001
    _, refused, _ = ws_talk(base.replace("/8300/", "/8301/") + "ws", ["x"], [])
    assert refused == [404]  # a port not exposed: the proxy refuses the handshake


def test_the_command_line_exposes_and_unexposes(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    sb.exec(SERVER.format(port=8400))
    env = {**os.environ, "DSEC_URL": daemon.url, "DSEC_TOKEN": daemon.token, "COLUMNS": "300"}
    out = subprocess.run(
        [sys.executable, "-m", "dsec", "expose", sb.id, "8400"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url == sb.expose(8400) and _wait(url + "hi.txt").text == "hello from inside\n"
    gone = subprocess.run(
        [sys.executable, "-m", "dsec", "unexpose", sb.id, "8400"], env=env, capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 0, gone.stderr
    assert httpx.get(url + "hi.txt", timeout=10).status_code == 404
    again = subprocess.run(
        [sys.executable, "-m", "dsec", "unexpose", sb.id, "8400"], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 2 and "not exposed" in again.stderr and "Traceback" not in again.stderr
