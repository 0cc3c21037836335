"""The E2B layer over the fake backend: the real ``e2b`` SDK against the E2B app on a loopback server
(no root), and the translation rules on their own (templates, networks, tokens, signatures, paging).
The fake backend's live commands behave like ``cat``: what is fed on stdin comes back on stdout."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import httpx
import pytest

from dsec.core.manager import SandboxManager
from dsec.e2b import file_urls
from dsec.e2b.auth import EnvdTokens
from dsec.e2b.control import network_spec
from dsec.e2b.control_lifecycle import on_timeout
from dsec.e2b.control_models import NetworkConfig, NewSandbox
from dsec.e2b.file_urls import Signed
from dsec.e2b.files import _gunzip
from dsec.e2b.process_service import end_event
from dsec.e2b.service import E2BOptions, E2BService
from dsec.errors import InvalidRequest, LimitExceeded
from dsec.protocol.network import NetworkAllow, NetworkDeny
from dsec.protocol.sandbox import ExecResult

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE, TOKEN

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox  # noqa: E402
from e2b.exceptions import AuthenticationException, SandboxException, SandboxNotFoundException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402
from e2b.sandbox.signature import get_signature  # noqa: E402

Core = tuple[SandboxManager, FakeBackend]


def _opts(base: str, key: str = TOKEN) -> dict[str, str]:
    return {"api_key": key, "api_url": base, "sandbox_url": base}


async def test_the_sdk_creates_runs_and_kills_over_the_core(served: tuple[str, SandboxManager, FakeBackend]) -> None:
    base, mgr, backend = served
    box = await AsyncSandbox.create(IMAGE, metadata={"job": "9"}, envs={"E": "1"}, timeout=120, **_opts(base))
    rec = mgr.record(box.sandbox_id)
    assert rec.labels == {"job": "9", "dsec.e2b.template": IMAGE} and rec.env == {"E": "1"}
    cat = await box.commands.run("cat", background=True, stdin=True, cwd="/tmp", envs={"X": "y"})
    await box.commands.send_stdin(cat.pid, "through the core")
    listed = await box.commands.list()
    assert [(p.pid, p.cmd, p.args, p.envs, p.cwd) for p in listed] == [
        (cat.pid, "/bin/bash", ["-l", "-c", "cat"], {"X": "y"}, "/tmp")
    ]
    await box.commands.close_stdin(cat.pid)
    assert (await cat.wait()).stdout == "through the core"
    assert backend.execs[-1].cwd == "/tmp" and backend.execs[-1].env["X"] == "y"
    backend.exit_code = 3
    with pytest.raises(CommandExitException) as failed:
        await box.commands.run("false")
    assert failed.value.exit_code == 3
    sleeper = await box.commands.run("sleep", background=True, stdin=True)
    assert await box.commands.kill(sleeper.pid) is True
    assert backend.signals[-1] == (sleeper.pid, 9)
    with pytest.raises(CommandExitException) as killed:
        await sleeper.wait()
    assert killed.value.exit_code == -1
    await box.files.write("/w/a.bin", b"\x00\x01\xff")
    assert bytes(await box.files.read("/w/a.bin", format="bytes")) == b"\x00\x01\xff"
    assert [e.name for e in await box.files.list("/w")] == ["a.bin"]
    info = await box.get_info()
    assert (info.metadata, info.template_id, info.state.value) == ({"job": "9"}, IMAGE, "running")
    assert await box.kill() is True and await box.kill() is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(box.sandbox_id, **_opts(base))


async def test_control_api_errors(served: tuple[str, SandboxManager, FakeBackend]) -> None:
    base, _, _ = served
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(IMAGE, **_opts(base, key="wrong"))
    with pytest.raises(SandboxException, match="404"):
        await AsyncSandbox.create("missing/image:1", **_opts(base))
    async with httpx.AsyncClient(base_url=base, headers={"X-API-KEY": TOKEN}) as http:
        bad = await http.post("/v2/sandboxes", json={"timeout": 5})
        assert bad.status_code == 400 and bad.json()["code"] == 400 and "templateID" in bad.json()["message"]
        assert (await http.get("/v2/sandboxes", params={"state": "exploded"})).status_code == 400
        assert (await http.get("/v2/sandboxes", params={"nextToken": "!!"})).status_code == 400
        assert (await http.get("/secrets")).status_code == 501
        reserved = await http.post(
            "/v2/sandboxes", json={"templateID": IMAGE, "metadata": {"dsec.e2b.mask-host": "a\r\nb: c"}}
        )
        assert reserved.status_code == 400 and "dsec's own" in reserved.json()["message"]
        many = await http.post(
            "/v2/sandboxes", json={"templateID": IMAGE, "metadata": {str(i): "v" for i in range(61)}}
        )
        assert many.status_code == 400 and "at most 60 keys" in many.json()["message"]
        assert (await http.post("/sandboxes/sb-nope/timeout", json={"timeout": 5})).status_code == 404
        # a method a path of ours does not have: a 405 naming every method it has (not E2B's 501)
        for method in ("DELETE", "TRACE"):
            refused = await http.request(method, "/v2/sandboxes")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET, POST", method


async def test_pages_and_metadata_filters(served: tuple[str, SandboxManager, FakeBackend]) -> None:
    base, _, _ = served
    ids = [
        (await AsyncSandbox.create(IMAGE, metadata={"p": "1", "n": str(i)}, **_opts(base))).sandbox_id for i in range(5)
    ]
    async with httpx.AsyncClient(base_url=base, headers={"X-API-KEY": TOKEN}) as http:
        seen: list[str] = []
        token = None
        while True:
            params = {"limit": "2", "metadata": "p=1"} | ({"nextToken": token} if token else {})
            page = await http.get("/v2/sandboxes", params=params)
            seen += [s["sandboxID"] for s in page.json()]
            token = page.headers.get("x-next-token")
            if not token:
                break
        assert seen == ids[::-1]  # newest first (E2B's order when none is named), each once
        one = await http.get("/v2/sandboxes", params={"metadata": "n=3"})
        assert [s["sandboxID"] for s in one.json()] == [ids[3]]
        desc = await http.get("/v2/sandboxes", params={"metadata": "p=1", "order": "desc"})
        assert [s["sandboxID"] for s in desc.json()] == ids[::-1]
        asc = await http.get("/v2/sandboxes", params={"metadata": "p=1", "order": "asc", "limit": "3"})
        assert [s["sandboxID"] for s in asc.json()] == ids[:3]
        rest = await http.get(
            "/v2/sandboxes", params={"metadata": "p=1", "order": "asc", "nextToken": asc.headers["x-next-token"]}
        )
        assert [s["sandboxID"] for s in rest.json()] == ids[3:]


async def test_idempotent_creates_and_trajectory_positions(served: tuple[str, SandboxManager, FakeBackend]) -> None:
    base, _, backend = served
    async with httpx.AsyncClient(base_url=base, headers={"X-API-KEY": TOKEN}) as http:
        body = {"templateID": IMAGE}
        first = await http.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "k-1"})
        again = await http.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == again.status_code == 201
        assert first.json()["sandboxID"] == again.json()["sandboxID"]

    async def rollout() -> tuple[str, str]:
        box = await AsyncSandbox.create(IMAGE, metadata={"dsec.trajectory": "t/1"}, **_opts(base))
        await box.files.write("/r.txt", "recorded")
        return box.sandbox_id, await box.files.read("/r.txt")

    sid, text = await rollout()
    writes = len(backend.files[sid])
    assert await rollout() == (sid, text)  # the same sandbox, the calls answered from the log
    assert len(backend.files[sid]) == writes


async def test_envd_routing_refuses_what_it_cannot_open(served: tuple[str, SandboxManager, FakeBackend]) -> None:
    base, mgr, _ = served
    rpc = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base) as http:
        made = (await http.post("/v2/sandboxes", json={"templateID": IMAGE}, headers={"X-API-KEY": TOKEN})).json()
        sid, token = made["sandboxID"], made["envdAccessToken"]
        opened = rpc | {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
        assert (await http.post("/process.Process/List", headers=opened, content=b"{}")).status_code == 200
        assert (await http.post("/process.Process/List", headers=rpc, content=b"{}")).status_code == 400
        wrong = await http.post("/process.Process/List", headers=opened | {"X-Access-Token": "bad"}, content=b"{}")
        assert wrong.status_code == 502 and "was not found" in wrong.json()["message"]
        proto = await http.post("/process.Process/List", headers=opened | {"Content-Type": "application/proto"})
        assert proto.status_code == 415  # JSON only, as the SDKs speak it
        await mgr.kill(sid)
        gone = await http.post("/process.Process/List", headers=opened, content=b"{}")
        assert gone.status_code == 502 and "was not found" in gone.json()["message"]
        assert (await http.get("/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})).status_code == 502


# ---- translation rules -----------------------------------------------------------------------------


def test_network_mapping() -> None:
    assert network_spec(None, None, "full") == "full"
    assert network_spec(None, None, None) is None
    assert network_spec(False, None, "full") is None
    assert network_spec(True, None, None) == "full"
    spec = network_spec(None, NetworkConfig(allowOut=["1.2.3.0/24", "pypi.org"], denyOut=["0.0.0.0/0"]), "full")
    assert isinstance(spec, NetworkAllow) and spec.allow == ["1.2.3.0/24:*", "pypi.org:*"]
    assert network_spec(None, NetworkConfig(allowOut=["1.2.3.4"]), None) == "full"  # nothing denied
    # denying some networks: "full" but those, allowOut reaching past them; dsec's own denials need no entry
    spec = network_spec(
        None, NetworkConfig(denyOut=["8.8.8.0/24", "169.254.169.254"], allowOut=["8.8.8.8", "pypi.org"]), "full"
    )
    assert spec == NetworkDeny(deny=["8.8.8.0/24:*"], allow=["8.8.8.8:*", "pypi.org:*"])
    assert network_spec(None, NetworkConfig(denyOut=["127.0.0.1/32"]), None) == "full"
    with pytest.raises(InvalidRequest, match="denyOut"):
        network_spec(None, NetworkConfig(denyOut=["8.8.8.8/16"]), "full")  # host bits set
    with pytest.raises(InvalidRequest, match="not a name"):
        network_spec(None, NetworkConfig(denyOut=["example.com"]), "full")
    with pytest.raises(InvalidRequest, match="rules"):
        network_spec(None, NetworkConfig(rules={"x": 1}), "full")


def test_timeout_actions() -> None:
    def action(**body: object) -> tuple[str, bool]:
        return on_timeout(NewSandbox.model_validate({"templateID": "base", **body}))

    assert action() == ("stop", False)
    assert action(autoPause=True) == ("pause", False)
    assert action(autoPause=True, autoPauseMemory=True, autoResume={"enabled": True}) == ("pause", True)
    assert action(autoPause=True, autoResume={"enabled": False}) == ("pause", False)
    assert action(lifecycle={"onTimeout": "pause", "autoResume": True}) == ("pause", True)
    assert action(lifecycle={"onTimeout": {"action": "pause"}}) == ("pause", False)
    assert action(lifecycle={"onTimeout": {"action": "kill"}}) == ("stop", False)
    for refused, why in (
        ({"autoPause": True, "autoPauseMemory": False}, "without memory"),
        ({"lifecycle": {"onTimeout": {"action": "pause", "keep_memory": False}}}, "without memory"),
        ({"autoResume": {"enabled": True}}, "autoResume needs"),
        ({"lifecycle": {"onTimeout": "hibernate"}}, "kill or pause"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            action(**refused)


def test_templates_and_options(fresh: Core, workdir: Path) -> None:
    mgr, _ = fresh
    opts = E2BOptions.of("http://127.0.0.1:9", "dsec/debian:12", "container", ["py=my/py:3@microvm"], "none")
    svc = E2BService(mgr, opts, EnvdTokens(b"k" * 32), TOKEN)
    assert svc.template("base", {}) == ("dsec/debian:12", "container")
    assert svc.template("py", {}) == ("my/py:3", "microvm")
    assert svc.template("img:1@vm", {}) == ("img:1", "vm")
    assert svc.template("img:1", {"dsec.kind": "function"}) == ("img:1", "function")
    with pytest.raises(InvalidRequest):
        svc.template("img:1@nope", {})
    with pytest.raises(InvalidRequest):
        svc.template("img:1", {"dsec.kind": "nope"})
    for bad in (
        ("unix:///x", "container", [], "full"),
        ("http://h:1", "boat", [], "full"),
        ("http://h:1", "vm", ["x"], "full"),
    ):
        with pytest.raises(InvalidRequest):
            E2BOptions.of(bad[0], "i", bad[1], bad[2], bad[3])
    assert opts.network is None


def test_tokens_and_the_sdks_own_signatures() -> None:
    tokens = EnvdTokens(b"s" * 32)
    token = tokens.token("sb-1")
    assert tokens.check("sb-1", token) and not tokens.check("sb-2", token) and not tokens.check("sb-1", "")
    assert EnvdTokens(b"t" * 32).token("sb-1") != token  # another daemon's key opens nothing here
    sig = get_signature("/tmp/a.txt", "read", "user", token)
    assert file_urls.check(token, "/tmp/a.txt", "read", "user", sig["signature"], None) is Signed.VALID
    assert file_urls.check(token, "/tmp/b.txt", "read", "user", sig["signature"], None) is Signed.INVALID
    assert file_urls.check(token, "/tmp/a.txt", "write", "user", sig["signature"], None) is Signed.INVALID
    assert file_urls.check(token, "/tmp/a.txt", "read", "root", sig["signature"], None) is Signed.INVALID
    other = tokens.token("sb-2")
    assert file_urls.check(other, "/tmp/a.txt", "read", "user", sig["signature"], None) is Signed.INVALID
    timed = get_signature("/f", "write", None, token, expiration_in_seconds=60)
    exp = str(timed["expiration"])
    assert file_urls.check(token, "/f", "write", "", timed["signature"], exp) is Signed.VALID
    # the expiration is signed: moving it later breaks the signature
    assert file_urls.check(token, "/f", "write", "", timed["signature"], str(int(exp) + 3600)) is Signed.INVALID
    old = get_signature("/f", "write", None, token, expiration_in_seconds=-5)
    assert file_urls.check(token, "/f", "write", "", old["signature"], str(old["expiration"])) is Signed.EXPIRED
    # a forged signature with a past expiration is invalid, not "expired"
    assert file_urls.check(token, "/f", "write", "", "v1_" + "A" * 43, str(old["expiration"])) is Signed.INVALID


def test_an_unnamed_signature_finds_the_sandbox_whose_token_made_it() -> None:
    tokens = EnvdTokens(b"s" * 32)
    ids = [f"sb-{n}" for n in range(50)]
    sig = get_signature("a.txt", "read", "", tokens.token("sb-31"), expiration_in_seconds=30)
    args = ("a.txt", "read", "", sig["signature"], str(sig["expiration"]))
    assert file_urls.signer(ids, tokens.token, *args) == ("sb-31", Signed.VALID)
    assert file_urls.signer([i for i in ids if i != "sb-31"], tokens.token, *args) == (None, Signed.INVALID)
    assert file_urls.signer(ids, EnvdTokens(b"t" * 32).token, *args) == (None, Signed.INVALID)
    assert file_urls.signer(ids, tokens.token, "b.txt", *args[1:]) == (None, Signed.INVALID)


def test_gzip_uploads_are_inflated_within_a_bound() -> None:
    assert _gunzip(gzip.compress(b"abc" * 10), 1000) == b"abc" * 10
    assert _gunzip(gzip.compress(b"one ") + gzip.compress(b"two"), 1000) == b"one two"  # members
    with pytest.raises(InvalidRequest, match="truncated"):
        _gunzip(gzip.compress(b"x" * 1000)[:-12], 5000)
    bomb = gzip.compress(b"\0" * (8 << 20))  # 8 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    with pytest.raises(LimitExceeded):
        _gunzip(bomb, 1 << 20)
    with pytest.raises(InvalidRequest):
        _gunzip(b"not gzip", 1000)


def test_end_events_read_like_envds() -> None:
    assert end_event(ExecResult(exit_code=0)).model_dump(exclude_none=True) == {
        "exit_code": 0,
        "exited": True,
        "status": "exit status 0",
    }
    killed = end_event(ExecResult(exit_code=137, signal=9))
    assert (killed.exit_code, killed.exited, killed.status) == (-1, False, "signal: killed")
    assert end_event(ExecResult(exit_code=143, signal=15)).status == "signal: terminated"
    oom = end_event(ExecResult(exit_code=137, signal=9, oom_killed=True))
    assert oom.error is not None and "out-of-memory" in oom.error
    assert end_event(ExecResult(exit_code=None)).exit_code == -1


def test_the_cluster_gateways_e2b_helpers() -> None:
    from dsec.cluster.e2b import _after, _demand, _key
    from dsec.cluster.proxy import Failure

    assert _demand(b'{"metadata": {"dsec.cpu": "2", "dsec.memory": "4Gi"}}').cpu == 2.0
    assert _demand(b'{"metadata": {"dsec.memory": "4Gi"}}').memory == (4 << 30) // 4  # a quarter: the request
    assert _demand(b"not json").cpu == 0.25 and _demand(b'{"metadata": {"dsec.cpu": "lots"}}').cpu == 0.25
    older = {"startedAt": "2026-12-04T04:00:00Z", "sandboxID": "sb-b"}
    newer = {"startedAt": "2026-12-04T04:00:00.5Z", "sandboxID": "sb-a"}
    assert sorted([newer, older], key=_key) == [older, newer]  # by time, whatever the precision written
    token = base64.urlsafe_b64encode(json.dumps(list(_key(older))).encode()).decode()
    assert _after(token) == _key(older)
    with pytest.raises(Failure):
        _after("%%%")


async def test_the_cluster_gateway_refuses_volumes() -> None:
    """A volume is one node's: the gateway's E2B API refuses them clearly, before any key or node."""
    from typing import cast

    from dsec.cluster.e2b import E2BGateway
    from dsec.cluster.gateway import Gateway

    gateway = E2BGateway(cast(Gateway, None))
    for method, path in (("POST", "/volumes"), ("GET", "/volumes/v"), ("PUT", "/volumecontent/v/file")):
        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object], sent: list[dict[str, object]] = sent) -> None:
            sent.append(message)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        await gateway({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
        body = json.loads(cast(bytes, sent[1]["body"]))
        assert sent[0]["status"] == 400 and "one node's disk" in body["message"], path
