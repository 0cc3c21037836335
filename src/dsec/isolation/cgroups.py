"""cgroup discovery and the few direct cgroup operations dsec needs beyond what the OCI runtime does.

crun creates each sandbox's cgroups and applies its limits. dsec adds what an OCI runtime does not
offer: a child cgroup per exec in the unified (v2) hierarchy, so a timeout kills the exec's whole
tree with ``cgroup.kill`` (double-forked and setsid'ed processes included) without touching other
execs; and OOM-kill counters. On a hybrid host (v1 controllers plus a v2 tree without controllers)
the v2 tree is used for grouping and killing only, and limits live in v1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendError

log = logging.getLogger("dsec.cgroups")

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupLayout:
    mode: str  # "v2" or "hybrid" (v1 controllers)
    unified: Path  # root of the v2 hierarchy
    memory_v1: Path | None

    def unified_dir(self, cg_path: str) -> Path:
        return self.unified / cg_path.strip("/")

    def oom_kills(self, cg_path: str) -> int:
        """OOM kills so far in this sandbox's memory cgroup."""
        if self.mode == "v2":
            f = self.unified_dir(cg_path) / "memory.events"
            key = "oom_kill"
        else:
            assert self.memory_v1 is not None
            f = self.memory_v1 / cg_path.strip("/") / "memory.oom_control"
            key = "oom_kill"
        return _counter(f, key)

    def pid_max_hits(self, cg_path: str) -> int:
        """Forks refused so far by this sandbox's pid limit."""
        base = self.unified if self.mode == "v2" else CGROUP_ROOT / "pids"
        return _counter(base / cg_path.strip("/") / "pids.events", "max")

    def limit_values(self, cg_path: str) -> tuple[str, ...]:
        """The sandbox's memory, pid and CPU limits as the kernel holds them (v2 or v1 files)."""
        rel = cg_path.strip("/")
        if self.mode == "v2":
            d = self.unified / rel
            files = [d / n for n in ("memory.max", "memory.swap.max", "pids.max", "cpu.max", "cpu.weight")]
        else:
            mem = (self.memory_v1 or CGROUP_ROOT / "memory") / rel
            cpu = CGROUP_ROOT / "cpu" / rel
            files = [mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"]
            files += [CGROUP_ROOT / "pids" / rel / "pids.max", cpu / "cpu.cfs_quota_us", cpu / "cpu.shares"]
        values = []
        for f in files:
            try:
                values.append(f.read_text().strip())
            except OSError:
                values.append("")
        return tuple(values)

    def usage(self, cg_path: str) -> tuple[int, int] | None:
        """CPU time used (ns) and memory charged now (bytes) of a group and its children; None if gone."""
        # read every few seconds for every live sandbox (core/usage.py): plain strings and bare syscalls,
        # a third of what pathlib and text files cost at 3,000 sandboxes
        rel = cg_path.strip("/")
        try:
            if self.mode == "v2":
                d = f"{self.unified}/{rel}"
                cpu_us = _counter(Path(f"{d}/cpu.stat"), "usage_usec")
                return cpu_us * 1000, int(_read(f"{d}/memory.current"))
            cpu_ns = int(_read(f"{CGROUP_ROOT}/cpuacct/{rel}/cpuacct.usage"))
            mem = int(_read(f"{self.memory_v1 or CGROUP_ROOT / 'memory'}/{rel}/memory.usage_in_bytes"))
            return cpu_ns, mem
        except (OSError, ValueError):
            return None


def _read(path: str | Path, size: int = 4096) -> bytes:
    """A cgroup file's contents by bare syscalls: a text file object costs twice what the read does."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _counter(f: Path, key: str) -> int:
    # every exec reads its sandbox's OOM counter before it starts: bare syscalls (_read)
    try:
        for line in _read(f, 1 << 16).splitlines():
            k, _, v = line.partition(b" ")
            if k == key.encode():
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _fs_type(path: Path) -> str | None:
    target = str(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == target:
                return right.split()[0]
    return None


def detect() -> CgroupLayout:
    root_type = _fs_type(CGROUP_ROOT)
    if root_type == "cgroup2":
        return CgroupLayout("v2", CGROUP_ROOT, None)
    unified = CGROUP_ROOT / "unified"
    if _fs_type(unified) != "cgroup2":
        raise BackendError(
            "dsec needs the cgroup v2 hierarchy (pure v2 at /sys/fs/cgroup, or hybrid with /sys/fs/cgroup/unified)"
        )
    return CgroupLayout("hybrid", unified, CGROUP_ROOT / "memory")


def hierarchies() -> list[str]:
    """The names under /sys/fs/cgroup that are cgroup (v1 or v2) mounts of their own (a hybrid host's)."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point, fstype = left.split()[4], right.split()[0]
            parent, _, name = point.rpartition("/")
            if parent == str(CGROUP_ROOT) and fstype in ("cgroup", "cgroup2"):
                found.append(name)
    return sorted(found)


def clone_cpusets(parent: str) -> None:
    """On a v1 cpuset hierarchy, have ``parent``'s new groups start with its CPUs and memory nodes
    (``cgroup.clone_children``). Otherwise the runtime writes them into each new group, and each such
    write checks the group against all its siblings and rebuilds the scheduler domains over every
    cpuset: 6% of the host's CPU in a burst of creations at 3,000 held."""
    group = CGROUP_ROOT / "cpuset" / parent.strip("/")
    if not (CGROUP_ROOT / "cpuset" / "cpuset.cpus").exists():
        return  # no v1 cpuset hierarchy here
    group.mkdir(exist_ok=True)
    for name in ("cpuset.cpus", "cpuset.mems"):
        if not (group / name).read_text().strip():
            (group / name).write_text((group.parent / name).read_text().strip())
    (group / "cgroup.clone_children").write_text("1")


def prepare_host(layout: CgroupLayout) -> list[str]:
    """Make the host usable by crun; returns what was changed, for the log.

    crun refuses hybrid hosts where a controller sits on the v2 tree. Any controller unused by v1
    shows up there (hugetlb, typically); mounting a v1 hierarchy for it takes it off the v2 tree.
    """
    changes: list[str] = []
    favoured = favor_dynamic_moves(layout.unified)
    if favoured:
        changes.append(favoured)
    if layout.mode != "hybrid":
        return changes
    controllers = (layout.unified / "cgroup.controllers").read_text().split()
    for ctrl in controllers:
        target = CGROUP_ROOT / ctrl
        from .mounts import mount

        target.mkdir(exist_ok=True)
        try:
            mount("cgroup", target, "cgroup", 0, ctrl)
        except OSError as e:
            # another daemon starting at the same moment may have mounted it first
            if ctrl in (layout.unified / "cgroup.controllers").read_text().split():
                raise BackendError(f"cannot mount a v1 {ctrl} hierarchy for crun: {e}") from e
            continue
        changes.append(f"mounted v1 {ctrl} hierarchy at {target}")
    return changes


def cgroup2_options(mountinfo: str, target: str) -> list[str] | None:
    """The super options of the cgroup2 mount at ``target`` in a mount table, but rw/ro; None: none there."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == target and " - cgroup2 " in line:
            return [o for o in line.split(" - ", 1)[1].split()[2].split(",") if o not in ("rw", "ro")]
    return None


def favor_dynamic_moves(unified: Path) -> str | None:
    """Remount the v2 hierarchy with ``favordynmods`` (kernel 6.0+); returns what changed, if anything.

    Moving a process into a cgroup (every exec joins its own; crun moves each container's init) takes
    a lock whose writers wait out an RCU grace period whenever none moved for a while: 12-15 ms on this
    2-core host, paid by the first exec after an agent's pause between two steps. ``favordynmods`` keeps
    that lock ready for writers, at a small cost to every fork and exit. The hierarchy's other options
    are kept (a remount clears what it is not given). ``DSEC_CGROUP_FAVORDYNMODS=0``: leave it as it is."""
    if os.environ.get("DSEC_CGROUP_FAVORDYNMODS") == "0":
        return None
    options = cgroup2_options(Path("/proc/self/mountinfo").read_text(), str(unified))
    if options is None or "favordynmods" in options:
        return None
    from .mounts import MS_REMOUNT, mount

    try:
        mount("cgroup2", unified, "cgroup2", MS_REMOUNT, ",".join([*options, "favordynmods"]))
    except OSError as e:  # an older kernel: no such option; execs then pay the wait after a pause
        log.warning("cannot remount %s with favordynmods: %s", unified, e)
        return None
    return f"remounted {unified} with favordynmods (no grace-period wait when a process changes cgroups)"


def make_exec_group(layout: CgroupLayout, cg_path: str, name: str) -> Path:
    d = layout.unified_dir(cg_path) / name
    d.mkdir()
    return d


def move_pid(group: Path, pid: int) -> None:
    (group / "cgroup.procs").write_text(str(pid))


def kill_group(group: Path) -> None:
    """Kill every process in the group and its descendants (cgroup.kill, kernel ≥ 5.14)."""
    kill_file = group / "cgroup.kill"
    if kill_file.exists():
        with contextlib.suppress(FileNotFoundError):
            kill_file.write_text("1")
        return
    # Older kernels: freeze-free best effort, repeated until the group is empty.
    for _ in range(50):
        pids = group_pids(group)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.01)


def remove_when_empty(group: Path, timeout: float = 1.0) -> bool:
    """``remove_group`` as soon as the group's (killed) processes are gone, checking often at first: they
    die within a millisecond or two unless the machine is busy."""
    deadline, pause = time.monotonic() + timeout, 0.0005
    while not remove_group(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def thaw(layout: CgroupLayout, cg_path: str) -> None:
    """Undo a pause (the runtime's freezer, v1 or v2): a frozen process does not die of SIGKILL until thawed."""
    targets = [(layout.unified_dir(cg_path) / "cgroup.freeze", "0")]
    if layout.mode == "hybrid":
        targets.append((CGROUP_ROOT / "freezer" / cg_path.strip("/") / "freezer.state", "THAWED"))
    for path, value in targets:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            path.write_text(value)


def signal_group(group: Path, sig: int) -> None:
    """Send ``sig`` to every process in the group and its descendants (SIGKILL: ``kill_group``)."""
    if sig == 9:
        kill_group(group)
        return
    for pid in group_pids(group):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def group_pids(group: Path) -> list[int]:
    """Every process in the group and its children; a child group that goes away meanwhile has none."""
    pids: list[int] = []
    for parent, _, files in os.walk(group):
        if "cgroup.procs" in files:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pids.extend(int(x) for x in Path(parent, "cgroup.procs").read_text().split())
    return pids


def remove_group(group: Path) -> bool:
    """rmdir a group and its children, deepest first; False if something still lives in it. Children that
    vanish meanwhile (an exec's own group, removed by its exec as it ends) count as removed."""
    try:
        group.rmdir()  # the common case, a group without children: no walk through its files
        return True
    except FileNotFoundError:
        return True
    except OSError:
        pass
    ok = True
    # bottom-up, and os.walk passes over a directory that is gone by the time it is listed
    for parent, dirs, _ in os.walk(group, topdown=False):
        for name in dirs:
            ok = _rmdir(Path(parent, name)) and ok
    return _rmdir(group) and ok


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def describe_members(group: Path, most: int = 8) -> str:
    """The processes left in a group, as the sandbox sees them (its own pids), with their state and
    where the kernel holds them: what a kill that did not work needs to be understood."""
    pids = group_pids(group)
    if not pids:
        return "nothing in its cgroup (the exit was not reported)"
    parts = []
    for pid in pids[:most]:
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
            )
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
            ns_pid = status.get("NSpid", "?").split()[-1]
            parts.append(f"{status.get('Name', '?').strip()}[{ns_pid}] {status.get('State', '?').strip()} in {wchan}")
        except (OSError, IndexError):
            parts.append("(exited meanwhile)")
    more = f" and {len(pids) - most} more" if len(pids) > most else ""
    return "; ".join(parts) + more


def host_pid_for_nspid(group: Path, ns_pid: int) -> int | None:
    """The host pid of the process in ``group`` whose innermost pid-namespace pid is ``ns_pid``."""
    try:
        candidates = [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return None
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return pid
                        break
        except (OSError, ValueError):
            continue
    return None
