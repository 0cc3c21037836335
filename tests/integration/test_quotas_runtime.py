"""The container kind's fallback exec path (``crun exec``, init catatonit) keeps the same bounds: the
sandbox's rlimits (crun's exec would give the process crun's own), idle-output timeouts, and no way to
write the host's runtime log through the init's stdio."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon


@pytest.fixture(scope="module")
def rsb(runtime_daemon: Daemon) -> Iterator[dsec.Sandbox]:
    sb = dsec.Sandbox.create(
        image="dsec/busybox", client=runtime_daemon.client(), nofile=777, file_size="2Mi", disk="32Mi"
    )
    yield sb
    sb.kill()


def test_rlimits_through_the_runtime_exec(rsb: dsec.Sandbox) -> None:
    assert "catatonit" in rsb.exec("cat /proc/1/cmdline").stdout
    res = rsb.exec("ulimit -Sn; ulimit -Hn; ulimit -f")
    soft, hard, blocks = res.stdout.split()
    assert (soft, hard) == ("777", "777")
    assert int(blocks) * 512 == 2 << 20 or int(blocks) * 1024 == 2 << 20
    res = rsb.exec("exec dd if=/dev/zero of=/tmp/big bs=1M count=8")
    assert res.signal == 25, res


def test_idle_timeout_through_the_runtime_exec(rsb: dsec.Sandbox) -> None:
    started = time.monotonic()
    res = rsb.exec("echo a; setsid sleep 3001 & sleep 3000", timeout=120, idle_timeout=1.0)
    assert res.idle_timed_out and res.timed_out and res.stdout == "a\n"
    assert time.monotonic() - started < 20
    assert "sleep 300" not in rsb.exec("ps -o args").stdout


def test_the_inits_stdio_reaches_no_host_file(rsb: dsec.Sandbox, runtime_daemon: Daemon) -> None:
    log = runtime_daemon.state_dir / "sandboxes" / rsb.id / "runtime.log"
    before = log.stat().st_size
    res = rsb.exec(
        "for fd in 0 1 2; do echo planted-by-the-sandbox >> /proc/1/fd/$fd; done 2>&1; ls -l /proc/1/fd/", user="root"
    )
    assert "runtime.log" not in res.stdout
    assert log.stat().st_size == before
    assert b"planted-by-the-sandbox" not in log.read_bytes()
