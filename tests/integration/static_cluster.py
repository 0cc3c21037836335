"""Two real node daemons (TCP, each serving the E2B API too) behind ``dsec cluster gateway`` (with
``--e2b-listen``): the cluster the gateway tests drive through the gateway alone."""

from __future__ import annotations

import contextlib
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

import dsec

from .conftest import IMAGES_DIR, free_port, release_node


@dataclass
class Cluster:
    token: str
    nodes: list[tuple[str, Path, subprocess.Popen[bytes]]]  # (dsec URL, state dir, process)
    gateway: subprocess.Popen[bytes]
    url: str  # the gateway's dsec API
    e2b_url: str  # the gateway's E2B API

    def opts(self) -> dict[str, str]:
        """The e2b SDK's options to reach the cluster through the gateway."""
        return {"api_key": self.token, "api_url": self.e2b_url, "sandbox_url": self.e2b_url}

    def client(self) -> dsec.Client:
        return dsec.Client(url=self.url, token=self.token)


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


@contextlib.contextmanager
def static_cluster(prefix: str) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix=prefix))
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
        yield Cluster(token, nodes, gateway, listen, e2b_listen)
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
