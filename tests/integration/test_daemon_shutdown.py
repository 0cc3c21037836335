"""A daemon stopped with SIGTERM leaves nothing of its own running, unless sandboxes outlive it: then the
layer fetcher and the layer mounts stay for them, the log says so, and the next daemon adopts them."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec.isolation.mounts import is_mountpoint, mount

from .conftest import Daemon, release_node, start_daemon


def processes_of(state_dir: Path) -> list[str]:
    """Every process whose command line names the state directory (the daemon, its fetcher, ...)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(state_dir) in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline.strip()[:200]}")
    return found


def mounts_under(state_dir: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(state_dir))]


def stop(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(30)


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-stop-"))
    yield path
    release_node(path)


def _settled(state_dir: Path, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := processes_of(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_sigterm_with_no_sandbox_left_leaves_no_process_and_no_mount(state: Path) -> None:
    d = start_daemon(state)
    sb = dsec.Sandbox.create(image="dsec/busybox", client=d.client())
    assert sb.exec("echo hi").stdout == "hi\n"
    fetcher = int((state / "images" / "fetcher" / "fetcher.pid").read_text())
    assert Path(f"/proc/{fetcher}").exists() and mounts_under(state)
    sb.kill()
    stop(d)  # uvicorn exits by the same signal once its shutdown is done: the log says it ran
    assert _settled(state) == []
    assert not Path(f"/proc/{fetcher}").exists()
    assert mounts_under(state) == []
    assert "layer fetcher stopped" in d.log.read_text()


def test_sandboxes_that_outlive_the_daemon_keep_the_fetcher_until_the_last_is_gone(state: Path) -> None:
    d = start_daemon(state)
    sb = dsec.Sandbox.create(image="dsec/busybox", client=d.client(), timeout=300)
    sb.exec("echo kept > /tmp/mark")
    stop(d)
    fetcher = int((state / "images" / "fetcher" / "fetcher.pid").read_text())
    assert Path(f"/proc/{fetcher}").exists(), "the fetcher serves the running sandbox's layers"
    assert "outlive this daemon" in d.log.read_text()

    again = start_daemon(state)
    adopted = dsec.Sandbox.connect(sb.id, client=again.client())
    assert adopted.exec("cat /tmp/mark").stdout == "kept\n"
    adopted.kill()
    stop(again)
    assert _settled(state) == [] and mounts_under(state) == []


def test_a_state_directory_on_a_file_system_of_its_own_stays_mounted(state: Path) -> None:
    """What the daemon releases at its stop is what it mounted itself: an operator's mount of the state
    directory (a disk of its own, say) stays."""
    mount("dsec-test-state", state, "tmpfs", 0, "size=512m,mode=0711")
    try:
        d = start_daemon(state)
        dsec.Sandbox.create(image="dsec/busybox", client=d.client()).kill()
        stop(d)
        assert _settled(state) == []
        assert is_mountpoint(state) and mounts_under(state) == [str(state)]
    finally:
        release_node(state)
