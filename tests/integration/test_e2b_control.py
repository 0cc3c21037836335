"""The unmodified ``e2b`` SDK against a live daemon: the control API's order of lists, metrics by time
range, what a sandbox does at its timeout (killed at once, or paused and resumed by a connect or by
traffic to its ports), snapshots listed by sandbox and name, and egress deny lists changed while it runs."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta

import pytest

import dsec

from .conftest import Daemon
from .port_servers import fetch

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, SandboxQuery, SandboxState  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402


def _wait(what: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_lists_are_newest_first_unless_asked_otherwise(boxes: list[Sandbox]) -> None:
    tag = secrets.token_hex(4)
    for i in range(3):
        boxes.append(Sandbox.create(metadata={"run": tag, "i": str(i)}, timeout=120))
    newest = [b.sandbox_id for b in reversed(boxes)]
    pages = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=2)
    seen = pages.next_items()
    assert pages.has_next
    seen += pages.next_items()
    assert [s.sandbox_id for s in seen] == newest and not pages.has_next


@pytest.mark.timeout(120)
def test_metrics_answer_the_range_asked(boxes: list[Sandbox]) -> None:
    start = datetime.now(UTC)
    box = Sandbox.create(timeout=120)
    boxes.append(box)
    box.commands.run("head -c 50000000 /dev/urandom | sha256sum")
    _wait(lambda: len(box.get_metrics(start=start, end=datetime.now(UTC))) >= 2)
    end = datetime.now(UTC)
    samples = box.get_metrics(start=start, end=end)
    assert all(start - timedelta(seconds=1) <= s.timestamp <= end + timedelta(seconds=1) for s in samples)
    assert [s.timestamp for s in samples] == sorted(s.timestamp for s in samples)
    assert all(s.mem_total == 512 << 20 and s.cpu_count >= 1 for s in samples) and any(s.mem_used > 0 for s in samples)
    assert box.get_metrics(start=start - timedelta(hours=1), end=start - timedelta(minutes=30)) == []
    later = box.get_metrics(start=samples[-1].timestamp + timedelta(seconds=1))
    assert all(s.timestamp > samples[-1].timestamp for s in later)


def test_past_its_timeout_a_sandbox_is_gone_at_once(boxes: list[Sandbox]) -> None:
    box = Sandbox.create(timeout=120)
    boxes.append(box)
    box.set_timeout(1)
    time.sleep(1.1)
    assert not box.is_running()  # not at the reaper's next pass
    other = Sandbox.create(timeout=120)
    boxes.append(other)
    other.set_timeout(0)  # E2B's "now"
    assert not other.is_running()
    with pytest.raises(e2b.exceptions.NotFoundException):
        other.get_info()


@pytest.mark.timeout(120)
def test_a_sandbox_that_pauses_at_its_timeout_is_resumed_by_connect(boxes: list[Sandbox]) -> None:
    box = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": False})
    boxes.append(box)
    info = box.get_info()
    assert info.lifecycle is not None and info.lifecycle["on_timeout"] == "pause"
    assert info.lifecycle["auto_resume"] is False
    box.files.write("/tmp/kept.txt", "kept")
    box.commands.run("nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
    _wait(lambda: box.get_info().state == SandboxState.PAUSED)
    assert not box.is_running()
    assert box.get_info().end_at > datetime.now(UTC) + timedelta(days=1)  # kept paused, not reaped
    box.connect(timeout=60)
    assert box.get_info().state == SandboxState.RUNNING and box.is_running()
    assert box.files.read("/tmp/kept.txt") == "kept"
    assert box.commands.run("kill -0 $(cat /tmp/sleeper)").exit_code == 0  # its processes too: memory was kept
    assert box.get_info().end_at < datetime.now(UTC) + timedelta(seconds=61)
    # the timeout reached now pauses it too; so does a pause, which E2B keeps until a resume
    box.set_timeout(0)
    assert box.get_info().state == SandboxState.PAUSED
    box.connect()
    assert box.pause() is True
    assert box.get_info().end_at > datetime.now(UTC) + timedelta(days=1)


def test_a_pause_without_memory_is_refused_not_turned_into_another(boxes: list[Sandbox]) -> None:
    with pytest.raises(SandboxException, match="without memory"):
        Sandbox.create(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    box = Sandbox.create(timeout=120)
    boxes.append(box)
    with pytest.raises(SandboxException, match="without memory"):
        box.pause(mode="filesystem")
    assert box.is_running()


@pytest.mark.timeout(120)
def test_traffic_to_a_port_resumes_a_sandbox_made_with_auto_resume(
    boxes: list[Sandbox], e2b_env: dict[str, str]
) -> None:
    box = Sandbox.create(
        timeout=120,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        network={"allow_public_traffic": False, "mask_request_host": "app.example.test:${PORT}"},
    )
    boxes.append(box)
    box.files.write("/srv/www/hi.txt", "hello\n")
    box.commands.run("cd /srv/www && nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    listener, host, token = e2b_env["E2B_SANDBOX_URL"], box.get_host(8000), box.traffic_access_token
    assert fetch(listener, host, "/hi.txt", token).text == "hello\n"
    box.set_timeout(0)
    assert box.get_info().state == SandboxState.PAUSED
    assert fetch(listener, host, "/hi.txt", token).text == "hello\n"  # woken by the request
    assert box.get_info().state == SandboxState.RUNNING
    # maskRequestHost: the Host the server is told
    box.commands.run('cp /dev/null /tmp/seen; nohup python3 -c "$SRV" >/dev/null 2>&1 &', envs={"SRV": _HOST_SERVER})
    fetch(listener, box.get_host(8100), "/", token)
    assert box.files.read("/tmp/seen") == "app.example.test:8100"
    # the SDK's own calls wake it too
    assert box.pause() is True
    assert box.commands.run("echo awake").stdout == "awake\n"
    assert box.get_info().state == SandboxState.RUNNING
    # without autoResume, traffic finds a paused sandbox gone (E2B's proxy answer)
    plain = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    boxes.append(plain)
    plain.commands.run("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    assert fetch(listener, plain.get_host(8000), "/", plain.traffic_access_token).status_code == 200
    plain.pause()
    answer = fetch(listener, plain.get_host(8000), "/", plain.traffic_access_token, patient=False)
    assert answer.status_code == 502 and plain.get_info().state == SandboxState.PAUSED


_HOST_SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        open('/tmp/seen', 'w').write(self.headers['Host'])
        self.send_response(204)
        self.end_headers()
http.server.HTTPServer(('127.0.0.1', 8100), H).serve_forever()
"""


def test_snapshots_are_listed_by_sandbox_and_name(boxes: list[Sandbox]) -> None:
    box = Sandbox.create(timeout=120)
    boxes.append(box)
    box.files.write("/srv/snap.txt", "in the snapshot")
    name = f"e2b-snap-{secrets.token_hex(3)}"
    first = box.create_snapshot()
    named = box.create_snapshot(name=name)
    try:
        assert named.names == [f"{name}:latest"]
        mine = {s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=box.sandbox_id).next_items()}
        assert mine == {first.snapshot_id, named.snapshot_id}
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [named.snapshot_id]
        assert Sandbox.list_snapshots(name=f"{name}-nope").next_items() == []
        pages = Sandbox.list_snapshots(sandbox_id=box.sandbox_id, limit=1)
        assert [s.snapshot_id for s in pages.next_items()] == [named.snapshot_id]  # newest first
        assert [s.snapshot_id for s in pages.next_items()] == [first.snapshot_id] and not pages.has_next
        copy = Sandbox.create(named.snapshot_id, timeout=60)
        try:
            assert copy.files.read("/srv/snap.txt") == "in the snapshot"
        finally:
            copy.kill()  # an image a live sandbox runs on is not deleted
    finally:
        for snap in (first, named):
            Sandbox.delete_snapshot(snap.snapshot_id)
    assert Sandbox.list_snapshots(sandbox_id=box.sandbox_id).next_items() == []


def test_deny_lists_are_set_at_creation_and_changed_while_running(daemon: Daemon, boxes: list[Sandbox]) -> None:
    box = Sandbox.create(timeout=120, network={"deny_out": ["203.0.113.0/24"], "allow_public_traffic": False})
    boxes.append(box)
    native = dsec.Sandbox.connect(box.sandbox_id, client=daemon.client())
    assert native.network_status().policy == dsec.NetworkDeny(deny=["203.0.113.0/24:*"])
    box.update_network({"deny_out": ["198.51.100.7"], "allow_out": ["198.51.100.0/24"]})
    assert native.network_status().policy == dsec.NetworkDeny(deny=["198.51.100.7:*"], allow=["198.51.100.0/24:*"])
    box.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": ["198.51.100.7"]})
    assert native.network_status().policy == dsec.NetworkAllow(allow=["198.51.100.7:*"])
    box.update_network({})
    assert native.network_status().policy == "full"
    with pytest.raises(SandboxException, match="not a name"):
        box.update_network({"deny_out": ["example.com"]})
    assert native.network_status().policy == "full"


def test_an_mcp_config_reaches_the_sdk_s_gateway_and_its_failure_leaves_nothing(e2b_env: dict[str, str]) -> None:
    """The server takes ``mcp`` as E2B's does; the SDK then starts ``mcp-gateway`` in the sandbox, which
    the default image does not hold: the SDK kills the sandbox and says so, and none is left running."""
    tag = {"mcp-test": secrets.token_hex(4)}
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create("base", timeout=60, metadata=tag, mcp={"exa": {"apiKey": "x"}})  # type: ignore[arg-type]
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING], metadata=tag)).next_items()
    assert running == []
