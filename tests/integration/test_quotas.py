"""Resource bounds of a step and of a sandbox, for every kind: idle-output timeouts, RLIMIT_NOFILE and
RLIMIT_FSIZE, orphaned zombies, and hostile tar uploads. One sandbox per kind for the module (VM kinds
run under TCG here). Disk, inode and /dev/shm quotas and processes that try to outlive their step are
red-team cases for every kind (tests/security/test_resources.py)."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon, require_kind

KINDS = ["container", "microvm", "vm"]
DISK = "64Mi"
FILE_SIZE = 8 << 20
NOFILE = 1000
BB = "/.dsec/busybox"


@pytest.fixture(scope="module", params=KINDS)
def box(request: pytest.FixtureRequest, daemon: Daemon) -> Iterator[dsec.Sandbox]:
    kind = request.param
    require_kind(daemon.client(), kind)
    sb = dsec.Sandbox.create(
        image="dsec/busybox",
        kind=kind,
        client=daemon.client(),
        memory="256Mi",
        disk=DISK,
        nofile=NOFILE,
        file_size=FILE_SIZE,
        timeout=1800,
    )
    yield sb
    sb.kill()


def _sh(sb: dsec.Sandbox, script: str, **kw: object) -> dsec.ExecResult:
    """As root, with the helper busybox (the same in every kind)."""
    kw.setdefault("timeout", 120)
    return sb.exec([BB, "sh", "-c", script], user="root", **kw)  # type: ignore[arg-type]


def test_idle_timeout_kills_a_silent_step(box: dsec.Sandbox) -> None:
    started = time.monotonic()
    res = box.exec("echo started; sleep 60", timeout=120, idle_timeout=1.5)
    assert res.timed_out and res.idle_timed_out and res.stdout == "started\n"
    assert time.monotonic() - started < 30
    # output keeps it alive; the wall clock still ends it, and says it was not the idle one
    res = box.exec("while :; do echo tick; sleep 0.3; done", timeout=3, idle_timeout=1.5)
    assert res.timed_out and not res.idle_timed_out and res.stdout.count("tick") >= 3
    events = list(box.exec_stream("echo a; sleep 60", timeout=120, idle_timeout=1.5))
    assert events[0].type == "stdout" and events[0].data == "a\n"
    final = events[-1].result
    assert final is not None and final.idle_timed_out and final.timed_out


def test_rlimits_apply_to_every_exec(box: dsec.Sandbox) -> None:
    for user in ("root", None):
        res = box.exec("ulimit -Sn; ulimit -Hn; ulimit -f", user=user)
        soft, hard, blocks = res.stdout.split()
        assert (soft, hard) == (str(NOFILE), str(NOFILE)), res.stdout
        assert int(blocks) * 512 == FILE_SIZE or int(blocks) * 1024 == FILE_SIZE, res.stdout
    # the writer of a file past RLIMIT_FSIZE gets SIGXFSZ; ignoring it, EFBIG; the sandbox carries on
    res = _sh(box, "exec dd if=/dev/zero of=/tmp/big bs=1M count=32")
    assert res.signal == 25, res
    res = _sh(box, "trap '' XFSZ; dd if=/dev/zero of=/tmp/big bs=1M count=32; echo status=$?; ls -l /tmp/big")
    assert "status=1" in res.stdout and "too large" in res.stderr.lower(), res
    assert str(FILE_SIZE) in res.stdout
    assert _sh(box, "rm /tmp/big && echo ok").stdout == "ok\n"


def _survivors(sb: dsec.Sandbox, marker: str) -> list[str]:
    out = _sh(sb, "ps -o pid,args").stdout
    return [line for line in out.splitlines() if marker in line and "ps -o" not in line]


def test_orphaned_zombies_are_reaped(box: dsec.Sandbox) -> None:
    # 200 children that exit at once, after their parent became `sleep` (which never waits): zombies,
    # orphaned when it exits; the sandbox's init (or the agent, as subreaper) must reap them
    children = "i=0; while [ $i -lt 200 ]; do ( read x < /tmp/zgo ) & i=$((i+1)); done; : > /tmp/zready; exec sleep 5"
    wait = "n=0; while [ ! -e /tmp/zready ] && [ $n -lt 900 ]; do sleep 0.1; n=$((n+1)); done; sleep 0.5"
    release = "echo go > /tmp/zgo; sleep 1; ps -o stat | grep -c '^Z' || true"
    setup = "rm -f /tmp/zready /tmp/zgo; mkfifo /tmp/zgo"
    res = _sh(box, f"{setup}; {BB} sh -c '{children}' & {wait}; {release}")
    assert int(res.stdout.strip() or 0) >= 150, res  # the zombies did exist
    deadline = time.monotonic() + 20
    while True:
        zombies = _sh(box, "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"' | wc -l").stdout.strip()
        if zombies == "0" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert zombies == "0"


def _tar(*entries: tuple[str, bytes, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, kind, data, link in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data)
            info.linkname = link
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_hostile_uploads_are_refused_before_unpacking(box: dsec.Sandbox) -> None:
    box.files.upload_tar("/up", _tar(("ok.txt", tarfile.REGTYPE, b"fine", ""), ("l", tarfile.SYMTYPE, b"", "ok.txt")))
    assert box.files.read("/up/l") == b"fine"
    hostile = [
        _tar(("a", tarfile.REGTYPE, b"1", ""), ("../../escape", tarfile.REGTYPE, b"x", "")),
        _tar(("a", tarfile.REGTYPE, b"1", ""), ("/abs", tarfile.REGTYPE, b"x", "")),
        _tar(("a", tarfile.REGTYPE, b"1", ""), ("dev", tarfile.CHRTYPE, b"", "")),
        _tar(("a", tarfile.REGTYPE, b"1", ""), ("l", tarfile.SYMTYPE, b"", "/etc")),
        _tar(("a", tarfile.REGTYPE, b"1", ""), ("h", tarfile.LNKTYPE, b"", "../../etc/passwd")),
    ]
    for data in hostile:
        with pytest.raises(dsec.InvalidRequest) as exc:
            box.files.upload_tar("/hostile", data)
        assert "tar entry" in str(exc.value)
    # refused before unpacking: not even the harmless first entry arrived
    assert _sh(box, "ls /hostile 2>&1 || echo none").stdout.strip().endswith("none")
    too_big = _tar(("big", tarfile.REGTYPE, b"\0" * ((64 << 20) + 1), ""))
    with pytest.raises(dsec.LimitExceeded):
        box.files.upload_tar("/big", too_big)
