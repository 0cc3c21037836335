"""The fallback exec path (the runtime's own `crun exec`), used when a sandbox has no agent channel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon


@pytest.fixture
def rsb(runtime_daemon: Daemon) -> Iterator[dsec.Sandbox]:
    sb = dsec.Sandbox.create(image="dsec/busybox", client=runtime_daemon.client())
    yield sb
    sb.kill()


def test_same_results_without_agent(rsb: dsec.Sandbox) -> None:
    assert "catatonit" in rsb.exec("cat /proc/1/cmdline").stdout
    res = rsb.exec("cd /tmp && pwd; echo $X; cat; exit 3", env={"X": "y"}, stdin="in")
    assert (res.exit_code, res.stdout) == (3, "/tmp\ny\nin")
    assert rsb.exec(["/no/such"]).exit_code == 127
    killed = rsb.exec("kill -9 $$")
    assert killed.signal == 9


def test_timeout_kills_tree_without_agent(rsb: dsec.Sandbox) -> None:
    res = rsb.exec("setsid sleep 1000 & (sleep 1001 &); sleep 1002", timeout=1)
    assert res.timed_out
    assert "sleep 100" not in rsb.exec("ps -o args").stdout


def test_archives_without_agent(rsb: dsec.Sandbox) -> None:
    rsb.files.write("/d/a.txt", b"a")
    tar = rsb.files.download_tar("/d")
    rsb.files.upload_tar("/e", tar)
    assert rsb.files.read("/e/a.txt") == b"a"


def test_exec_as_another_account_without_agent(rsb: dsec.Sandbox) -> None:
    rsb.exec("echo agent:x:1000:1000::/:/bin/sh >> /etc/passwd")
    assert rsb.exec("id -u; id -g", user="agent").stdout == "1000\n1000\n"
    assert rsb.exec("id -u", user="2000:3000").stdout == "2000\n"
    assert rsb.exec("id -u").stdout == "0\n"
