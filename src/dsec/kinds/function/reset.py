"""Resetting a function worker between users, and verifying the reset rather than assuming it.

A worker is a container sandbox whose init (the agent) outlives its users. What a user can leave
behind, and how each is dealt with, from the host:

- processes, detached or not: every exec runs in its own cgroup under the worker's; each is killed
  (cgroup.kill) and removed, then the worker's cgroup must hold the agent alone;
- files: /tmp (a directory beside the writable layer, bound in) is emptied on the host; /dev/shm and
  /dev/mqueue, the container's own, through the agent's root. Everything else (the overlay's writable layer, /dev)
  must match the fingerprint taken when the worker was made, or the worker is not reused;
- network: the worker's network namespace must have no socket left (TIME_WAIT included);
- limits and counters: the cgroup's limits must be as made; an OOM kill or a hit pid limit marks the
  use hostile. The worker has no cgroup file system, so its counters are never visible inside;
- System V IPC objects, which outlive their processes: looked up from a thread that joins the
  worker's IPC namespace for the read (only that namespace's /proc/sysvipc shows them).

Any mismatch is a failed verification: the worker is destroyed and replaced, never reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...isolation import cgroups

SCRATCH = ("dev/shm", "dev/mqueue")  # emptied between users, through the agent's root (and /tmp)
# per-namespace socket counts (sockstat's inuse and tw); /proc/PID/net/tcp would walk the host's whole
# TCP hash table for each read (measured: the costliest part of a reset), these do not
SOCKET_COUNTS = ("sockstat", "sockstat6")
SOCKET_TABLES = ("unix", "packet")  # per-namespace lists: a line per socket
KILL_WAIT = 2.0
IPC_TABLES = ("shm", "sem", "msg")
CLONE_NEWIPC = 0x08000000
_libc = ctypes.CDLL(None, use_errno=True)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
Entry = tuple[str, int, int, int, int, int, int]  # path, mode, uid, gid, size (rdev), mtime_ns, ino


@dataclass(frozen=True)
class Fingerprint:
    """What a clean worker looks like from the host."""

    upper: frozenset[Entry]
    dev: frozenset[Entry]
    limits: tuple[str, ...]
    sockets: tuple[int, ...]
    agent_start: str  # the agent's start time: a pid reused by another process would differ


@dataclass
class Counters:
    """The cgroup events a use must not raise (read when it starts, compared when it ends)."""

    oom_kills: int
    pid_max_hits: int


def _walk(top: int, prefix: str, skip: frozenset[str] = frozenset()) -> set[Entry]:
    """Every entry under directory fd ``top``, without following symlinks or leaving the file system."""
    out: set[Entry] = set()
    with os.scandir(top) as it:
        entries = list(it)
    for e in entries:
        path = f"{prefix}/{e.name}"
        if path in skip:
            continue
        st = e.stat(follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            # /dev/null and friends are the host's nodes, bound in: anyone's write moves their times
            out.add((path, st.st_mode, st.st_uid, st.st_gid, st.st_rdev, 0, st.st_ino))
            continue
        size = st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else 0
        out.add((path, st.st_mode, st.st_uid, st.st_gid, size, st.st_mtime_ns, st.st_ino))
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
            try:
                if os.fstat(fd).st_dev == os.fstat(top).st_dev:
                    out |= _walk(fd, path, skip)
            finally:
                os.close(fd)
    return out


def _open_in(pid: int, rel: str) -> int:
    """A directory in the agent's view of its root, each component opened without following links."""
    fd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel.split("/"):
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _agent_start(pid: int) -> str:
    # field 22 of /proc/PID/stat, after the parenthesised command (which may hold spaces)
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[19]


def _sockets(pid: int) -> tuple[int, ...]:
    counts = []
    for name in SOCKET_COUNTS:
        try:
            text = Path(f"/proc/{pid}/net/{name}").read_text()
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            words = line.split()
            # "TCP: inuse 1 orphan 0 tw 0 alloc 1 mem 0": alloc and mem are host-wide, not the worker's
            counts += [int(words[i + 1]) for i, w in enumerate(words[:-1]) if w in ("inuse", "tw", "used")]
    for table in SOCKET_TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()
        except FileNotFoundError:
            counts.append(0)
            continue
        counts.append(max(0, len(lines) - 1))
    return tuple(counts)


def counters(layout: cgroups.CgroupLayout, cg_path: str) -> Counters:
    return Counters(layout.oom_kills(cg_path), layout.pid_max_hits(cg_path))


def fingerprint(layout: cgroups.CgroupLayout, cg_path: str, upper: Path, pid: int) -> Fingerprint:
    """The clean state of a freshly made worker (run in a thread)."""
    return Fingerprint(
        upper=frozenset(_upper(upper)),
        dev=frozenset(_dev(pid)),
        limits=layout.limit_values(cg_path),
        sockets=_sockets(pid),
        agent_start=_agent_start(pid),
    )


def _upper(upper: Path) -> set[Entry]:
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _walk(fd, "")
    finally:
        os.close(fd)


def _dev(pid: int) -> set[Entry]:
    fd = _open_in(pid, "dev")
    try:
        # pts: a closed terminal's entry goes by itself; shm and mqueue are emptied, then checked empty
        return _walk(fd, "", skip=frozenset({"/pts", "/shm", "/mqueue"}))
    finally:
        os.close(fd)


def kill_users(group: Path, agent_pid: int, keep: str) -> str | None:
    """Kill every process in the exec cgroups under the worker's, remove those groups but ``keep``
    (emptied, for the next use's first exec); None when only the agent is left."""
    children = [d for d in group.iterdir() if d.is_dir()]
    for d in children:
        cgroups.kill_group(d)
    deadline = time.monotonic() + KILL_WAIT
    for d in children:
        while True:
            try:
                if d.name == keep:
                    if not _populated(d):
                        break
                else:
                    d.rmdir()  # fails while populated (no child cgroup can be made inside)
                    break
            except FileNotFoundError:
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return f"processes of a previous user survived cgroup.kill in {d.name}"
            time.sleep(0.001)
    if not (group / keep).is_dir():
        return "the worker's kept exec group is gone"
    procs = [int(p) for p in (group / "cgroup.procs").read_text().split()]
    if procs != [agent_pid]:
        return f"the worker's cgroup holds {procs}, not the agent ({agent_pid}) alone"
    return None


def _populated(group: Path) -> bool:
    for line in (group / "cgroup.events").read_text().splitlines():
        if line.startswith("populated "):
            return line.split()[1] != "0"
    return False


def _empty(fd: int) -> None:
    with os.scandir(fd) as it:
        entries = list(it)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.name, dir_fd=fd)
        else:
            os.unlink(e.name, dir_fd=fd)


def wipe_and_verify(
    layout: cgroups.CgroupLayout, cg_path: str, upper: Path, tmp: Path, pid: int, clean: Fingerprint, before: Counters
) -> str | None:
    """After kill_users: empty the scratch directories and compare the worker against ``clean``.
    Returns why the worker must not be reused, or None (run in a thread)."""
    now = counters(layout, cg_path)
    if now.oom_kills > before.oom_kills:
        return "a process was killed by the out-of-memory killer"
    if now.pid_max_hits > before.pid_max_hits:
        return "the pid limit was hit"
    try:
        if _agent_start(pid) != clean.agent_start:
            return "the agent is not the one the worker was made with"
    except (FileNotFoundError, ProcessLookupError):
        return "the agent is gone"
    for rel in ("tmp", *SCRATCH):
        fd = os.open(tmp, _DIR) if rel == "tmp" else _open_in(pid, rel)
        try:
            _empty(fd)
            with os.scandir(fd) as it:
                if any(True for _ in it):
                    return f"/{rel} is not empty after the wipe"
        finally:
            os.close(fd)
    if layout.limit_values(cg_path) != clean.limits:
        return "the cgroup limits changed"
    if _sockets(pid) != clean.sockets:
        return "sockets are left in the worker's network namespace"
    changed = _upper(upper) ^ clean.upper
    if changed:
        return f"the writable layer changed ({_describe(changed)})"
    changed = _dev(pid) ^ clean.dev
    if changed:
        return f"/dev changed ({_describe(changed)})"
    if ipc_objects(pid):
        return "System V IPC objects are left"
    return None


def _describe(entries: set[Entry]) -> str:
    paths = sorted({e[0] for e in entries})
    shown = ", ".join(paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def ipc_objects(pid: int) -> int:
    """System V IPC objects (shared memory, semaphores, message queues) in ``pid``'s IPC namespace,
    counted by a short-lived thread that joins that namespace for the reads."""
    out: list[int | BaseException] = []

    def count() -> None:
        try:
            out.append(_count_ipc(pid))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=count, name="dsec-ipc-check", daemon=True)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _count_ipc(pid: int) -> int:
    own = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, CLONE_NEWIPC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the worker's IPC namespace: {os.strerror(err)}")
        try:
            return sum(len(Path(f"/proc/sysvipc/{t}").read_text().splitlines()) - 1 for t in IPC_TABLES)
        finally:
            # the thread ends right after, whether or not this succeeds: nothing else ever runs in it
            _libc.setns(own, CLONE_NEWIPC)
    finally:
        os.close(own)
        os.close(target)


def remove_stale(sandbox_dir: Path, live: set[str], prefix: str) -> list[str]:
    """Worker bundles a previous daemon left behind that nobody uses now (their containers are
    destroyed by the caller)."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(p.name for p in sandbox_dir.iterdir() if p.name.startswith(prefix) and p.name not in live)
    return []
