"""The unmodified ``e2b`` SDK against a live daemon: the sandbox lifecycle (list, info, timeouts, kill,
pause and resume), clear errors for bad input and for what dsec does not support, tenants kept apart,
the in-sandbox API's routing and tokens, and trajectories recorded and fast-forwarded."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

import dsec

from .conftest import Daemon

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
)


def test_list_info_timeout_and_kill(boxes: list[Sandbox]) -> None:
    tag = secrets.token_hex(4)
    boxes += [Sandbox.create(metadata={"run": tag, "i": str(i)}, timeout=300) for i in range(3)]
    mine = Sandbox.list(query=SandboxQuery(metadata={"run": tag}))
    assert {s.sandbox_id for s in mine.next_items()} == {b.sandbox_id for b in boxes}
    paged = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=2)
    first = paged.next_items()
    assert len(first) == 2 and paged.has_next
    rest = paged.next_items()
    assert (
        len(rest) == 1 and not paged.has_next and {s.sandbox_id for s in first + rest} == {b.sandbox_id for b in boxes}
    )
    assert (
        Sandbox.list(query=SandboxQuery(metadata={"run": tag, "i": "1"})).next_items()[0].sandbox_id
        == boxes[1].sandbox_id
    )
    info = boxes[0].get_info()
    assert (info.template_id, info.metadata, info.state.value) == ("base", {"run": tag, "i": "0"}, "running")
    assert info.memory_mb == 512 and info.cpu_count >= 1 and info.end_at > info.started_at
    boxes[0].set_timeout(2)
    assert (boxes[0].get_info().end_at - info.started_at).total_seconds() < 300
    time.sleep(4.5)  # the daemon reaps it at its new time to live
    assert not boxes[0].is_running()
    with pytest.raises(SandboxNotFoundException):
        boxes[0].get_info()
    assert boxes[1].kill() is True and boxes[1].kill() is False
    assert Sandbox.kill(boxes[2].sandbox_id) is True
    with pytest.raises(SandboxNotRunningException):
        boxes[2].commands.run("true")
    assert Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items() == []


def test_pause_and_resume(boxes: list[Sandbox]) -> None:
    box = Sandbox.create(timeout=300)
    boxes.append(box)
    box.files.write("/tmp/kept.txt", "before the pause")
    assert box.pause() is True
    assert box.pause() is False  # already paused
    assert box.get_info().state.value == "paused"
    with pytest.raises(SandboxException, match="paused"):
        box.commands.run("true")
    box.connect()  # resumes, as E2B's connect does
    assert box.get_info().state.value == "running"
    assert box.commands.run("cat /tmp/kept.txt").stdout == "before the pause"
    busy = box.commands.run("sleep 60", background=True)
    with pytest.raises(SandboxException, match="command"):
        box.pause()  # not while a command runs: its timeout keeps counting on the host
    busy.kill()


def test_clear_errors_for_bad_input_and_unsupported_features(e2b_env: dict[str, str], boxes: list[Sandbox]) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-dsec-token")
    with pytest.raises(SandboxException, match=r"404.*not found"):
        Sandbox.create("no-such-image:1")
    with pytest.raises(SandboxException, match="not a sandbox kind"):
        Sandbox.create("dsec/debian:12@spaceship")
    with pytest.raises(SandboxException, match=r"400.*memory"):
        Sandbox.create(metadata={"dsec.memory": "lots"})
    with pytest.raises(SandboxException, match="400"):
        Sandbox.create(timeout=30 * 24 * 3600)
    with pytest.raises(SandboxException, match=r"without memory.*not supported"):
        Sandbox.create(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    with pytest.raises(SandboxException, match=r"denyOut.*not a name"):
        Sandbox.create(network={"deny_out": ["example.com"], "allow_public_traffic": False})
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("sb-000000000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("sb-000000000000")
    assert Sandbox.kill("sb-000000000000") is False
    box = Sandbox.create(timeout=120)
    boxes.append(box)
    # a container's copies get its files, each made on its own: one entry per copy asked
    box.files.write("/home/user/state.txt", "forked\n")
    copies = box.fork(count=2)
    assert len(copies) == 2 and all(isinstance(c, Sandbox) for c in copies), copies
    for c in copies:
        boxes.append(c)
        assert c.sandbox_id != box.sandbox_id
        assert c.files.read("/home/user/state.txt") == "forked\n"
    copies[0].files.write("/home/user/state.txt", "mine\n")
    assert box.files.read("/home/user/state.txt") == copies[1].files.read("/home/user/state.txt") == "forked\n"
    url = e2b_env["E2B_API_URL"]
    templates = httpx.get(f"{url}/templates", headers={"X-API-KEY": e2b_env["E2B_API_KEY"]})
    assert templates.status_code == 501 and "not supported" in templates.json()["message"]


def test_envd_calls_are_routed_by_sandbox_and_opened_only_by_its_token(
    e2b_env: dict[str, str], boxes: list[Sandbox]
) -> None:
    a = Sandbox.create(timeout=120)
    boxes.append(a)
    url = e2b_env["E2B_SANDBOX_URL"]
    # the SDK keeps a sandbox's token to itself: take it from a create's answer, as any client gets it
    created = httpx.post(
        f"{e2b_env['E2B_API_URL']}/v2/sandboxes",
        headers={"X-API-KEY": e2b_env["E2B_API_KEY"]},
        json={"templateID": "base", "timeout": 60},
    ).json()
    c_id, c_token = created["sandboxID"], created["envdAccessToken"]
    boxes.append(Sandbox.connect(c_id))
    rpc = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}

    def listing(sandbox_id: str | None, token: str | None) -> httpx.Response:
        headers = dict(rpc)
        if sandbox_id:
            headers["E2b-Sandbox-Id"] = sandbox_id
        if token:
            headers["X-Access-Token"] = token
        return httpx.post(f"{url}/process.Process/List", headers=headers, content=b"{}")

    assert listing(c_id, c_token).status_code == 200
    missing = listing(None, c_token)
    assert missing.status_code == 400 and "E2b-Sandbox-Id" in missing.json()["message"]
    # another sandbox's token, no token, a forged one, an unknown sandbox: all answered alike
    for sandbox_id, token in ((a.sandbox_id, c_token), (c_id, None), (c_id, "x" * 43), ("sb-000000000000", c_token)):
        refused = listing(sandbox_id, token)
        assert refused.status_code == 502 and "was not found" in refused.json()["message"], (sandbox_id, token)
    assert httpx.get(f"{url}/health").status_code == 204


def test_tenants_see_only_their_own_sandboxes(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    op = daemon.client()
    suffix = secrets.token_hex(3)
    alice, bob = (op.create_tenant(f"e2b-{who}-{suffix}").token for who in ("alice", "bob"))
    opts = {"api_url": e2b_env["E2B_API_URL"], "sandbox_url": e2b_env["E2B_SANDBOX_URL"]}
    box = Sandbox.create(api_key=alice, timeout=120, **opts)
    try:
        assert box.commands.run("echo mine").stdout == "mine\n"
        assert box.sandbox_id in {s.sandbox_id for s in Sandbox.list(api_key=alice, **opts).next_items()}
        assert box.sandbox_id not in {s.sandbox_id for s in Sandbox.list(api_key=bob, **opts).next_items()}
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(box.sandbox_id, api_key=bob, **opts)
        assert Sandbox.kill(box.sandbox_id, api_key=bob, **opts) is False
        assert box.is_running()
        owned = dsec.Sandbox.connect(box.sandbox_id, client=op).info()
        assert owned.owner == f"e2b-alice-{suffix}"
    finally:
        box.kill()


def test_a_trajectory_is_recorded_and_fast_forwarded(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    tid = f"e2b-job/{secrets.token_hex(4)}"
    meta = {"dsec.trajectory": tid}

    def rollout() -> tuple[str, list[str]]:
        box = Sandbox.create(metadata=meta, timeout=300)
        outs = [box.commands.run("date +%s%N > /tmp/t; cat /tmp/t").stdout]
        box.files.write("/tmp/answer.txt", "42")
        outs.append(box.files.read("/tmp/answer.txt"))
        outs.append(box.commands.run("echo $RANDOM$RANDOM").stdout)
        return box.sandbox_id, outs

    first_id, first = rollout()
    started = time.monotonic()
    again_id, again = rollout()  # a resumed trainer repeats its calls: answered from the log
    replay_s = time.monotonic() - started
    assert again_id == first_id and again == first and replay_s < 10
    box = Sandbox.connect(first_id)
    assert box.commands.run("cat /tmp/t").stdout == first[0]  # the live sandbox never re-ran them
    with pytest.raises(SandboxException, match="trajectory"):
        box.commands.run("cat", background=True, stdin=True)
    ops = [c.op for c in daemon.client().trajectory_calls(tid)]
    assert ops[:5] == ["create", "exec", "write", "read", "exec"] and "exec" in ops[5:]
    box.kill()
    # and the audit log has the E2B calls, like dsec's own
    audited = daemon.client().audit(sandbox=first_id, limit=1000)
    routes = {(r.route, r.command) for r in audited}
    assert ("e2b /v2/sandboxes", None) in routes and ("e2b /v2/sandboxes/{sandbox_id}/connect", None) in routes
    assert any(route == "e2b /process.Process/Start" and cmd and "cat /tmp/t" in cmd for route, cmd in routes)
