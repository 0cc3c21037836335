"""Resource bounds of a step and of a sandbox, for every kind: idle-output timeouts, RLIMIT_NOFILE and
RLIMIT_FSIZE, disk / inode / /dev/shm quotas, processes that try to outlive their step, orphaned zombies,
and hostile tar uploads. One sandbox per kind for the module (VM kinds run under TCG here)."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon

KINDS = ["container", "microvm", "vm"]
DISK = "64Mi"
FILE_SIZE = 8 << 20
NOFILE = 1000
BB = "/.dsec/busybox"


@pytest.fixture(scope="module", params=KINDS)
def box(request: pytest.FixtureRequest, daemon: Daemon) -> Iterator[dsec.Sandbox]:
    kind = request.param
    try:
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
    except dsec.InvalidRequest as e:
        pytest.skip(f"{kind}: {e}")
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


def test_disk_and_inode_quotas_end_in_enospc(box: dsec.Sandbox) -> None:
    fill = "for i in 1 2 3 4 5 6 7 8 9 10; do dd if=/dev/zero of=f$i bs=1M count=7 2>&1 || break; done"
    res = _sh(box, f"mkdir -p /fill && cd /fill && {fill}")
    assert "No space left" in res.stdout, res
    # the file API sees a full disk too, and says so
    with pytest.raises(dsec.LimitExceeded):
        box.files.write("/fill/more", b"x" * (4 << 20))
    assert _sh(box, "rm -rf /fill && echo ok").stdout == "ok\n"
    script = "mkdir -p /inodes && cd /inodes && i=0; while true > f$i; do i=$((i+1)); done; echo $i; : > g"
    res = _sh(box, script, timeout=600)
    created = int(res.stdout.split()[0])
    assert 1000 < created <= 16384, res
    assert "No space left" in res.stderr
    assert _sh(box, "rm -rf /inodes && echo ok", timeout=300).stdout == "ok\n"
    assert box.exec("echo alive").stdout == "alive\n"


def test_dev_shm_is_bounded(box: dsec.Sandbox) -> None:
    res = _sh(box, "[ -d /dev/shm ] || exit 3; df -k /dev/shm | tail -1 | awk '{print $2}'")
    if res.exit_code == 3 and box.kind == "vm":
        pytest.skip("this image's init mounts no /dev/shm")
    assert 0 < int(res.stdout) * 1024 <= 128 << 20, res
    # files under RLIMIT_FSIZE each, until the tmpfs is full
    fill = "for i in $(seq 1 30); do dd if=/dev/zero of=/dev/shm/f$i bs=1M count=7 2>&1 || break; done"
    res = _sh(box, f"{fill}; rm -f /dev/shm/f*")
    assert "No space left" in res.stdout


def _survivors(sb: dsec.Sandbox, marker: str) -> list[str]:
    out = _sh(sb, "ps -o pid,args").stdout
    return [line for line in out.splitlines() if marker in line and "ps -o" not in line]


@pytest.mark.parametrize("deadline", ["timeout", "idle"])
def test_no_process_outlives_a_killed_step(box: dsec.Sandbox, deadline: str) -> None:
    # setsid + double fork, SIGTERM and SIGHUP ignored: nothing of it may survive the step's kill
    script = (
        f"{BB} setsid {BB} sh -c 'trap \"\" TERM HUP INT; exec {BB} sleep 4241' </dev/null >/dev/null 2>&1 & "
        f"( {BB} setsid {BB} sh -c 'trap \"\" TERM HUP; {BB} sleep 4242 & {BB} sleep 4243' "
        "</dev/null >/dev/null 2>&1 & ) ; "
        f"( trap '' TERM; exec {BB} sleep 4244 ) & "
        "echo spawned; sleep 300"
    )
    kw = {"timeout": 3.0} if deadline == "timeout" else {"timeout": 120.0, "idle_timeout": 2.0}
    res = box.exec([BB, "sh", "-c", script], **kw)  # type: ignore[arg-type]
    assert res.timed_out and res.idle_timed_out == (deadline == "idle")
    assert res.stdout == "spawned\n"
    deadline_t = time.monotonic() + 10
    while (left := _survivors(box, "sleep 424")) and time.monotonic() < deadline_t:
        time.sleep(0.2)
    assert not left


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
