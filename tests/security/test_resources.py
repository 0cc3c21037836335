"""Resource attacks: bombs, fills, floods, spins and processes that try to outlive their step.

The attacker has ATTACKER_LIMITS (conftest); the safe outcome is the limit enforced by the platform
(its report: timed_out, oom_killed, truncated; its files API; the daemon's own memory from /proc),
the attacker usable again afterwards, and the neighbour's heartbeat within bounds.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

import dsec

from .conftest import CONTAINER_KINDS, Daemon, heartbeat

# the daemon may grow by this much over a flood: far below what the flood writes (gigabytes)
DAEMON_RSS_SLACK_KB = 64 << 10


def _recovered(sb: dsec.Sandbox, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if sb.exec("echo ok", timeout=10).stdout == "ok\n":
                return
        except dsec.DsecError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("the attacker did not recover after its step ended")
        time.sleep(0.5)


def _daemon_memory_kb(d: Daemon) -> tuple[int, int]:
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def test_fork_bomb_is_contained(
    kind: str, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    sb = fresh_attacker()
    count = "ps -o pid | wc -l"  # a VM's guest lists its kernel threads too: compared with before the bomb
    before = int(sb.exec(count).stdout)
    # every kind bounds the bomb with the sandbox's pids limit (a VM: the guest's cgroup holding every
    # exec's own), so the sandbox, its agent and the neighbour stay up
    with heartbeat(neighbour):
        # The step's own shell forks once, before any bomb exists, then waits with `exec sleep`, which
        # needs no new pid: a shell that forks while the bomb runs loses that race now and then, and busybox
        # sh exits at once on "can't fork", ending the step early (a plain `sleep`, or the pipeline's second
        # fork when the bomb was started from the step's shell itself, both did)
        res = sb.exec("(bomb() { bomb | bomb & }; bomb) & exec sleep 5", timeout=4)
    assert res.timed_out
    _recovered(sb)
    deadline = time.monotonic() + 10
    while (left := int(sb.exec(count).stdout) - before) > 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left <= 3, f"{left} processes of the bomb outlived its step"


def test_memory_bomb_is_oom_killed(kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    with heartbeat(neighbour):
        res = attacker.exec("x=a; while true; do x=$x$x; done", timeout=60)
    assert not res.timed_out and (res.exit_code == 137 or res.signal == 9), res
    _recovered(attacker)
    # VM kinds: the guest agent reports an OOM kill by the guest's kernel during the command
    assert res.oom_killed, res
    assert not attacker.exec("true").oom_killed  # and only then


def test_dev_shm_fill_is_bounded(kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    with heartbeat(neighbour):
        res = attacker.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=1024", timeout=60)
    attacker.exec("rm -f /dev/shm/fill")
    assert res.exit_code != 0 or res.oom_killed, res
    if kind == "vm" and "No such file" in res.stderr:
        return  # per kind: the vm kind's busybox init mounts no /dev/shm at all: nothing to fill
    assert "No space left" in res.stderr or res.oom_killed, res
    _recovered(attacker)


def test_disk_fill_is_bounded(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    with heartbeat(neighbour):
        res = attacker.exec("dd if=/dev/zero of=/var/fill bs=1M count=1024; sync", timeout=60)
    assert "No space left" in res.stderr, res
    # the platform's view: the file stopped at the sandbox's disk cap (128 MiB)
    size = next(e.size for e in attacker.files.list("/var") if e.name == "fill")
    attacker.files.remove("/var/fill")
    assert 0 < size <= 128 << 20, size
    attacker.files.write("/var/after-fill", b"still writable")
    attacker.files.remove("/var/after-fill")


def test_inode_exhaustion_is_bounded(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    with heartbeat(neighbour):
        res = attacker.exec(
            "mkdir -p /var/inodes && cd /var/inodes && seq 1 2000000 | xargs touch 2>&1 | head -3", timeout=90
        )
    assert "No space left" in res.stdout + res.stderr, res
    attacker.exec("rm -rf /var/inodes", timeout=120)
    attacker.files.write("/var/after-inodes", b"ok")
    attacker.files.remove("/var/after-inodes")


def _flood(sec_daemon: Daemon, sb: dsec.Sandbox, neighbour: dsec.Sandbox, cmd: str, timeout: float) -> dsec.ExecResult:
    rss_before, _ = _daemon_memory_kb(sec_daemon)
    with heartbeat(neighbour):
        res = sb.exec(cmd, timeout=timeout, output_limit=1 << 20)
    rss_after, hwm = _daemon_memory_kb(sec_daemon)
    assert res.truncated, res.stdout_bytes
    assert len(res.stdout.encode()) <= (1 << 20) + 4096 and len(res.stderr.encode()) <= (1 << 20) + 4096
    assert rss_after - rss_before < DAEMON_RSS_SLACK_KB, (rss_before, rss_after, hwm)
    assert hwm - rss_before < DAEMON_RSS_SLACK_KB * 2, (rss_before, rss_after, hwm)
    return res


def test_output_flood_yes(sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    res = _flood(sec_daemon, attacker, neighbour, "yes", timeout=4)
    assert res.timed_out and res.stdout.startswith("y\ny\n")
    assert res.stdout_bytes > 4 << 20


def test_output_flood_one_two_gigabyte_line(
    sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    res = _flood(sec_daemon, attacker, neighbour, "head -c 2000000000 /dev/zero | tr '\\0' a; echo END", timeout=8)
    head, _, tail = res.stdout.partition(" bytes truncated by dsec ...]")
    assert head.startswith("a" * 4096) and tail.strip("\n").strip("a") in ("", "END"), res.stdout[-200:]
    assert res.stdout_bytes > 4 << 20


def test_output_flood_both_streams(sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    res = _flood(sec_daemon, attacker, neighbour, "yes out & yes err >&2 & wait", timeout=4)
    assert res.stdout.startswith("out\n") and res.stderr.startswith("err\n")
    assert res.stdout_bytes > 1 << 20 and res.stderr_bytes > 1 << 20


def test_cpu_spin_on_all_cores(fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox) -> None:
    sb = fresh_attacker()
    with heartbeat(neighbour):
        res = sb.exec("for i in 1 2 3 4 5 6 7 8; do (while :; do :; done) & done; wait", timeout=4)
    assert res.timed_out
    _recovered(sb)
    assert "while" not in sb.exec("ps -o args").stdout


def test_processes_do_not_outlive_their_step(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    tag = 3000 + secrets.randbelow(5000)  # sleep durations nothing else on this node uses
    script = (
        f"setsid sleep {tag} & "
        f"( (sleep {tag + 1} &) & ); "
        f"sh -c 'trap \"\" TERM HUP INT; sleep {tag + 2}' & "
        f"nohup sleep {tag + 3} >/dev/null 2>&1 & "
        f"trap '' TERM; sleep {tag + 4}"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=2)
    assert res.timed_out
    left = attacker.exec("ps -o args").stdout
    assert not [f"sleep {tag + i}" for i in range(5) if f"sleep {tag + i}" in left], left
    # from the host: no such process anywhere on the node (containers share the host's kernel)
    if attacker.kind in CONTAINER_KINDS:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmd = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                assert not (
                    cmd[:1] == [b"sleep"]
                    and cmd[1:2]
                    and cmd[1].startswith(str(tag)[:3].encode())
                    and cmd[1].decode().isdigit()
                    and tag <= int(cmd[1]) <= tag + 4
                ), cmd
