"""Integration fixtures: a real daemon in a subprocess, real crun, real cgroups.

The daemon fixture owns cleanup: it kills every sandbox it saw and stops the daemon. On failure the
daemon's log path is printed so it can be read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import dsec
from dsec.isolation.mounts import unmount_under
from dsec.protocol.build import ImageSpec

IMAGES_DIR = Path(os.environ.get("DSEC_TEST_IMAGES", "/var/tmp/dsec-test-images"))


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "integration tests need root (namespaces, cgroups, overlay mounts)"
    if not (shutil.which("crun") or shutil.which("runc")):
        return "no OCI runtime (crun or runc) installed"
    if not Path("/sys/fs/cgroup").exists():
        return "no cgroup file system"
    return None


SKIP = _missing()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if SKIP:
                item.add_marker(pytest.mark.skip(reason=SKIP))


@dataclass
class Daemon:
    state_dir: Path
    url: str
    token: str
    proc: subprocess.Popen[bytes]
    log: Path
    e2b_url: str | None = None  # the E2B-compatible API (E2B_API_URL, E2B_SANDBOX_URL), if served

    def client(self) -> dsec.Client:
        return dsec.Client(url=self.url, token=self.token)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def layer_bytes(digest: str, repository: Path = IMAGES_DIR / "repository") -> bytes:
    """A layer's EROFS image, read from the test repository (wherever the layer was built)."""
    import asyncio

    from dsec.images.catalog import Catalog
    from dsec.images.repository import LocalRepository

    async def read() -> bytes:
        catalog = Catalog(LocalRepository(repository))
        manifest = await catalog.layer(digest)
        parts = [await catalog.chunks.get_chunk(c) for c in manifest.chunks]
        return b"".join(parts)

    return asyncio.run(read())


def require_kind(client: dsec.Client, kind: str) -> None:
    """Skip only where the node's probe found a named prerequisite of ``kind`` missing (no QEMU binary,
    say): the reason is the node's. Any other failure to create a sandbox of the kind is a failure, and
    under CI (tests/conftest.py) even this skip is one."""
    why = client.node().unavailable.get(kind)
    if why is not None:
        pytest.skip(f"the {kind} kind is unavailable on this node: {why}")


def release_node(state_dir: Path) -> None:
    """What a daemon leaves running on purpose (the layer fetcher, layer mounts) so its sandboxes survive
    a restart: stopped here, after the test is done with the node."""
    pid_file = state_dir / "images" / "fetcher" / "fetcher.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass
    unmount_under(state_dir)


def resolves(host: str) -> bool:
    """Whether this machine can look ``host`` up (builds that fetch packages need the archive's name)."""
    try:
        socket.getaddrinfo(host, 80)
        return True
    except OSError:
        return False


def systemd_spec() -> ImageSpec:
    """Debian with systemd as its init, for the vm kind (a new spec each call: specs grow in place)."""
    return ImageSpec("dsec/debian:12").apt("systemd-sysv", "udev")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_daemon(
    state_dir: Path,
    *extra: str,
    module: str = "dsec",
    e2b: bool = False,
    repository: Path = IMAGES_DIR / "repository",
    listen: str | None = None,
) -> Daemon:
    """``python -m MODULE serve`` (the security suite's negative control passes its weakened entry point);
    ``e2b``: with the E2B-compatible API on a free loopback port; ``listen``: http://HOST:PORT instead of
    the state directory's socket."""
    state_dir.mkdir(parents=True, exist_ok=True)
    e2b_url = f"http://127.0.0.1:{free_port()}" if e2b else None
    if e2b_url is not None:
        extra = (*extra, "--e2b-listen", e2b_url)
    if listen is not None:
        extra = (*extra, "--listen", listen)
    log = state_dir / "daemon.log"
    sock = state_dir / "dsec.sock"
    url = listen or f"unix://{sock}"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "serve",
                "--state-dir",
                str(state_dir),
                "--repository",
                str(repository),
                "--log-level",
                "info",
                *extra,
            ],
            stdout=f,
            stderr=f,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {log.read_text()[-3000:]}")
        token_file = state_dir / "token"
        if (listen is not None or sock.exists()) and token_file.exists():
            token = token_file.read_text().strip()
            try:
                dsec.Client(url=url, token=token).health()
                return Daemon(state_dir, url, token, proc, log, e2b_url)
            except dsec.DaemonUnreachable:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"daemon did not come up: {log.read_text()[-3000:]}")


def shut_down(d: Daemon) -> None:
    """Kill what the daemon still runs, stop it, and release what it leaves on the node."""
    client = d.client()
    try:
        for info in client.list():
            dsec.Sandbox.connect(info.id, client=client).kill()
    except dsec.DsecError:
        pass
    d.stop()
    release_node(d.state_dir)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A directory of a module's own, removed after; readable by all, as a state dir below it must be
    for a sandbox's mapped root to get through."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def own_daemon(workdir: Path, *extra: str) -> Iterator[Daemon]:
    """A daemon of a module's own, with a layer repository of its own under ``workdir``, shut down after."""
    d = start_daemon(workdir / "state", *extra, repository=workdir / "repository")
    try:
        yield d
    finally:
        shut_down(d)


@pytest.fixture(scope="session")
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    state = Path(tempfile.mkdtemp(prefix="dsec-it-"))
    d = start_daemon(state, e2b=True)
    try:
        yield d
    finally:
        shut_down(d)
        if request.session.testsfailed:
            print(f"\n[dsec] integration daemon log kept: {d.log}")
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(autouse=True)
def _env(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", daemon.url)
    monkeypatch.setenv("DSEC_TOKEN", daemon.token)


@pytest.fixture
def make_sandbox(daemon: Daemon) -> Iterator[Callable[..., dsec.Sandbox]]:
    """Sandboxes (of dsec/busybox unless told), killed after the test; ``client``: who owns them."""
    made: list[dsec.Sandbox] = []
    operator = daemon.client()

    def make(client: dsec.Client | None = None, **kwargs: object) -> dsec.Sandbox:
        kwargs.setdefault("image", "dsec/busybox")
        sb = dsec.Sandbox.create(client=client or operator, **kwargs)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except dsec.DsecError:
            pass


@pytest.fixture
def sb(make_sandbox: Callable[..., dsec.Sandbox]) -> dsec.Sandbox:
    return make_sandbox()


def qemu_pid(sandbox_id: str) -> int:
    """The pid of a VM sandbox's QEMU, found by the ``-name dsec-<id>`` it runs with."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"dsec-{sandbox_id}".encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no QEMU process for {sandbox_id}")


@pytest.fixture(scope="session")
def runtime_daemon() -> Iterator[Daemon]:
    """A daemon whose container execs go through the runtime's exec (crun exec), not the sandbox agent."""
    os.environ["DSEC_CONTAINER_EXEC"] = "runtime"
    try:
        d = start_daemon(Path(tempfile.mkdtemp(prefix="dsec-rt-")), e2b=True)
    finally:
        del os.environ["DSEC_CONTAINER_EXEC"]
    yield d
    d.stop()
    release_node(d.state_dir)
    shutil.rmtree(d.state_dir, ignore_errors=True)


# ---- the E2B-compatible API (test_e2b*.py) --------------------------------------------------------


def e2b_environment(daemon: Daemon) -> dict[str, str]:
    assert daemon.e2b_url is not None, "the test daemon serves the E2B API"
    return {"E2B_API_URL": daemon.e2b_url, "E2B_SANDBOX_URL": daemon.e2b_url, "E2B_API_KEY": daemon.token}


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    env = e2b_environment(daemon)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def boxes(e2b_env: dict[str, str]) -> Iterator[list[Any]]:
    """The E2B sandboxes (e2b.Sandbox) a test makes and appends here, killed after it."""
    made: list[Any] = []
    yield made
    for box in made:
        box.kill()
