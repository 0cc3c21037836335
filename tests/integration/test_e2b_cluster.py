"""The E2B API of a cluster: two real node daemons (TCP, each serving the E2B API) behind ``dsec cluster
gateway --e2b-listen``, driven by the unmodified ``e2b`` SDK through the gateway alone."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import dsec

from .conftest import IMAGES_DIR, free_port, release_node

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import SandboxNotFoundException, SandboxNotRunningException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402


@dataclass
class Cluster:
    token: str
    nodes: list[tuple[str, Path, subprocess.Popen[bytes]]]  # (dsec URL, state dir, process)
    gateway: subprocess.Popen[bytes]
    e2b_url: str

    def opts(self) -> dict[str, str]:
        return {"api_key": self.token, "api_url": self.e2b_url, "sandbox_url": self.e2b_url}


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, ok: int = 200) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="dsec-e2b-cluster-"))
    root.chmod(0o711)  # crun, in a sandbox's user namespace, walks down to the state directories
    token = secrets.token_urlsafe(32)
    (root / "token").write_text(token + "\n")
    nodes = []
    for name in ("n1", "n2"):
        state = root / name
        state.mkdir()
        (state / "token").write_text(token + "\n")  # a cluster's nodes share the operator token
        url, e2b_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state), "--listen", url]
        argv += ["--e2b-listen", e2b_url, "--node-name", name, "--repository", str(IMAGES_DIR / "repository")]
        nodes.append((url, state, _spawn(argv, state / "daemon.log")))
    gateway = None
    try:
        for url, state, proc in nodes:
            _wait(f"{url}/v1/health", proc, state / "daemon.log")
        listen, e2b_listen = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "dsec", "cluster", "gateway", "--token-file", str(root / "token")]
        argv += ["--listen", listen, "--e2b-listen", e2b_listen, "--interval", "0.2", "--misses", "2"]
        for url, _, _ in nodes:
            argv += ["--node", url]
        gateway = _spawn(argv, root / "gateway.log")
        _wait(f"{e2b_listen}/health", gateway, root / "gateway.log", ok=204)
        yield Cluster(token, nodes, gateway, e2b_listen)
    finally:
        if gateway is not None:
            _stop(gateway)
        for url, state, proc in nodes:
            try:
                client = dsec.Client(url=url, token=token)
                for info in client.list():
                    dsec.Sandbox.connect(info.id, client=client).kill()
            except dsec.DsecError:
                pass
            _stop(proc)
            release_node(state)
        shutil.rmtree(root, ignore_errors=True)


def test_the_sdk_through_the_gateway_reaches_every_node(cluster: Cluster) -> None:
    tag = secrets.token_hex(4)
    boxes = [Sandbox.create(metadata={"run": tag}, timeout=300, **cluster.opts()) for _ in range(4)]
    try:
        homes = {}
        for url, _, _ in cluster.nodes:
            client = dsec.Client(url=url, token=cluster.token)
            for info in client.list():
                homes[info.id] = url
        assert {homes[b.sandbox_id] for b in boxes} == {url for url, _, _ in cluster.nodes}  # spread over both
        for i, box in enumerate(boxes):
            assert box.commands.run(f"echo box{i}").stdout == f"box{i}\n"
            box.files.write("/tmp/id.bin", bytes([i]) * 1000)
            assert bytes(box.files.read("/tmp/id.bin", format="bytes")) == bytes([i]) * 1000
        cat = boxes[0].commands.run("cat", background=True, stdin=True)
        boxes[0].commands.send_stdin(cat.pid, "via the gateway\n")
        boxes[0].commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "via the gateway\n"
        sleeper = boxes[1].commands.run("sleep 60", background=True)
        assert boxes[1].commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException):
            sleeper.wait()
        pages = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=3, **cluster.opts())
        seen = [s.sandbox_id for s in pages.next_items()]
        assert len(seen) == 3 and pages.has_next
        seen += [s.sandbox_id for s in pages.next_items()]
        assert sorted(seen) == sorted(b.sandbox_id for b in boxes) and not pages.has_next
        info = Sandbox.get_info(boxes[2].sandbox_id, **cluster.opts())
        assert info.metadata == {"run": tag} and info.state.value == "running"
        boxes[3].set_timeout(120)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info("sb-000000000000", **cluster.opts())
        with pytest.raises(SandboxNotRunningException):
            Sandbox.connect(boxes[3].sandbox_id, **cluster.opts()).kill()
            boxes[3].commands.run("true")
    finally:
        for box in boxes:
            box.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"run": tag}), **cluster.opts()).next_items() == []


def test_a_wrong_key_and_a_lost_node(cluster: Cluster) -> None:
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create(**(cluster.opts() | {"api_key": "not-the-cluster-token"}))
    url, _, proc = cluster.nodes[1]
    client = dsec.Client(url=url, token=cluster.token)
    boxes: list[Sandbox] = []
    while len(boxes) < 6 and not any(b.sandbox_id in {i.id for i in client.list()} for b in boxes):
        boxes.append(Sandbox.create(timeout=300, **cluster.opts()))  # placement spreads: soon one on n2
    on_lost = [b for b in boxes if b.sandbox_id in {i.id for i in client.list()}]
    assert on_lost, "placement never chose the second node"
    for info in client.list():  # the node goes, and its sandboxes with it
        dsec.Sandbox.connect(info.id, client=client).kill()
    proc.kill()
    proc.wait()
    try:
        time.sleep(1.5)  # two missed health checks at 0.2 s: the gateway calls the node lost
        for box in on_lost:
            with pytest.raises(SandboxNotRunningException):
                box.commands.run("true")
        survivor = Sandbox.create(timeout=300, **cluster.opts())  # placed on the node that is left
        assert survivor.commands.run("echo still serving").stdout == "still serving\n"
        survivor.kill()
    finally:
        for box in boxes:
            if box not in on_lost:
                box.kill()
