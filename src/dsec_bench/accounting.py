"""Leak accounting of one node: every host object a daemon makes for its sandboxes, counted, and a diff
that says which counters did not come back to their baseline.

A snapshot is a flat ``{counter: int}``. Host-wide objects (cgroups, uid leases, address leases,
interfaces, QEMU processes) are shared with any other daemon on the host, so they are attributed to
this node by name: the sandbox, worker and template-VM names it ever used (``Known``, gathered from its
state database and its bundle directories while it runs). Counters under ``host.`` are host-wide
totals, reported for context and never judged (other daemons change them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# dsec's names for the host objects it makes (its nftables table and veths, VMM jail keys and uid leases,
# where container uid ranges start), which nothing public states: attributing objects to this node needs
# them, and importing rather than copying them keeps a renamed object from silently counting zero.
from dsec.isolation import idmap
from dsec.isolation.network import nft
from dsec.kinds.microvm import jail

Counters = dict[str, int]

CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/run/netns")
ADDRESS_LEASES = Path("/run/dsec/net/by-index")
VMM_LEASES = jail.LEASES / "by-key"
QEMU_COMM = "qemu-system-x86"  # comm is cut at 15 characters
HOST_TMP_PREFIXES = ("dsec-kvm-probe-",)  # what dsec makes in /tmp (accel.py); host-wide
LIVE_STATES = ("creating", "running", "paused", "stopping")
ID_PREFIXES = ("sb-", "fw-")


def _node_hash(state_dir: Path, length: int) -> str:
    return hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:length]


@dataclass(frozen=True)
class Node:
    """The daemon under account: its pid and state directory (the fetcher's pid is in its pid file)."""

    state_dir: Path
    daemon_pid: int

    @property
    def fetcher_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.state_dir / "images" / "fetcher" / "fetcher.pid").read_text().strip())
        return None

    @property
    def table(self) -> str:
        return nft.table_name(str(self.state_dir.resolve()))

    @property
    def template_prefix(self) -> str:
        return f"tpl-{_node_hash(self.state_dir, 8)}-"  # microvm backend: this node's template VMs


@dataclass
class Known:
    """Names this node used: sandbox and worker ids, template-VM names. ``scan`` while the node runs
    (a bundle directory lives only as long as its sandbox; records keep the rest)."""

    node: Node
    ids: set[str] = field(default_factory=set)
    rowid: int = 0  # records read up to here (a record rewritten gets a new rowid: read again)

    def scan(self) -> None:
        state = self.node.state_dir
        for d in (state / "sandboxes", state / "vms"):
            with contextlib.suppress(OSError):
                self.ids.update(e.name for e in os.scandir(d) if e.name.startswith(ID_PREFIXES))
        ids, self.rowid = _record_ids(state / "state.db", self.rowid)
        self.ids.update(ids)
        templates = state / "vm-templates"
        with contextlib.suppress(OSError):
            for kind in os.scandir(templates):
                with contextlib.suppress(OSError):
                    self.ids.update(self.node.template_prefix + e.name[:16] for e in os.scandir(kind.path))

    def owns(self, name: str) -> bool:
        return name in self.ids or name.startswith(self.node.template_prefix)

    def vm_bundles(self) -> dict[str, Path]:
        """The VMM jail keys this node's VMs get (a name plus a hash of its bundle), by key."""
        state = self.node.state_dir
        out = {jail.key(i, state / "vms" / i): state / "vms" / i for i in self.ids if i.startswith("sb-")}
        templates = state / "vm-templates"
        with contextlib.suppress(OSError):
            for kind in os.scandir(templates):
                with contextlib.suppress(OSError):
                    for e in os.scandir(kind.path):
                        bundle = Path(e.path) / "build"
                        out[jail.key(self.node.template_prefix + e.name[:16], bundle)] = bundle
        return out


def _ro(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)


def _record_ids(db: Path, since: int = 0) -> tuple[set[str], int]:
    """Sandbox ids of the records after rowid ``since``, and the worker each function sandbox was lent;
    and the last rowid read."""
    ids: set[str] = set()
    if not db.exists():
        return ids, since
    with contextlib.suppress(sqlite3.Error), contextlib.closing(_ro(db)) as conn:
        query = "SELECT rowid, id, runtime FROM sandboxes WHERE rowid > ? ORDER BY rowid"
        for rowid, sid, runtime in conn.execute(query, (since,)):
            ids.add(sid)
            since = rowid
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                worker = json.loads(runtime).get("worker")
                if isinstance(worker, dict) and isinstance(worker.get("id"), str):
                    ids.add(worker["id"])
    return ids, since


# ---- the counters -----------------------------------------------------------------------------------


def mounts(node: Node) -> Counters:
    """Mount points at or below the state dir, by where (layers, sandboxes, the rest), and host-wide."""
    root = str(node.state_dir.resolve()).rstrip("/") + "/"
    out: Counter[str] = Counter({f"mounts.{w}": 0 for w in ("layers", "sandboxes", "vms", "helpers", "other")})
    with open(f"/proc/{node.daemon_pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            out["host.mounts"] += 1
            point = line.split()[4].replace("\\040", " ") + "/"
            if not point.startswith(root):
                continue
            rel = point[len(root) :]
            where = "layers" if rel.startswith(("images/", "vm-templates/")) else rel.split("/", 1)[0]
            out[f"mounts.{where if where in ('layers', 'sandboxes', 'vms', 'helpers') else 'other'}"] += 1
    out["mounts.loop_devices"] = loop_devices(node.state_dir)
    return dict(out)


def loop_devices(state_dir: Path) -> int:
    """Loop devices backed by a file in the state dir (layers mount through one where the kernel's EROFS
    cannot mount a file)."""
    root = str(state_dir.resolve()).rstrip("/") + "/"
    count = 0
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            count += backing.read_text().strip().startswith(root)
    return count


def _hierarchies() -> list[tuple[str, Path]]:
    """(name, root) of each cgroup hierarchy: the unified one alone on a pure v2 host; on a hybrid one
    each v1 hierarchy too (symlinked aliases such as ``cpu,cpuacct`` are skipped: counted once)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # the root is cgroup2 itself: a pure v2 host
        return [("unified", CGROUP_ROOT)]
    out = []
    with contextlib.suppress(OSError):
        for e in sorted(os.scandir(CGROUP_ROOT), key=lambda e: e.name):
            if e.is_dir(follow_symlinks=False) and os.path.exists(os.path.join(e.path, "cgroup.procs")):
                out.append((e.name, Path(e.path)))
    return out


def _groups_below(d: Path) -> int:
    count = 0
    for _dirpath, dirnames, _files in os.walk(d):
        count += len(dirnames)
    return count


def cgroups(known: Known) -> Counters:
    """dsec's cgroups (``dsec/<id>`` of containers and workers, ``dsec/vmm/<key>`` of VMMs, each with
    its children such as per-exec groups), per hierarchy; the unified one is ``unified`` here or the
    root on a pure v2 host."""
    out: Counter[str] = Counter()
    for name, hier in _hierarchies():
        out[f"cgroups.{name}"] += 0
        top = hier / "dsec"
        for parent in (top, top / "vmm"):
            with contextlib.suppress(OSError):
                for e in os.scandir(parent):
                    if not e.is_dir(follow_symlinks=False) or e.name == "vmm":
                        continue
                    groups = 1 + _groups_below(Path(e.path))
                    out["host.cgroups"] += groups
                    owner = e.name.rsplit(".", 1)[0] if parent.name == "vmm" else e.name
                    if known.owns(owner):
                        out[f"cgroups.{name}"] += groups
    return dict(out)


def uid_leases(known: Known) -> Counters:
    """VMM uid leases (host-wide, ``/run/dsec/vmm``) held by this node's VMs, and the container uid
    ranges its live records hold (the daemon leases those in memory; a record says which)."""
    keys = set(known.vm_bundles())
    held = 0
    total = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(VMM_LEASES):
            total += 1
            held += e.name in keys
    ranges = 0
    db = known.node.state_dir / "state.db"
    if db.exists():
        with contextlib.suppress(sqlite3.Error), contextlib.closing(_ro(db)) as conn:
            marks = ",".join("?" * len(LIVE_STATES))
            for (runtime,) in conn.execute(f"SELECT runtime FROM sandboxes WHERE state IN ({marks})", LIVE_STATES):
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    base = json.loads(runtime).get("uid_base")
                    ranges += isinstance(base, int) and base >= idmap.FIRST_BASE
    return {
        "uids.vmm_leases": held,
        "uids.container_ranges": ranges,
        "uids.ranges_used": len(_ranges_used(db)),
        "host.vmm_leases": total,
    }


def _ranges_used(db: Path) -> set[int]:
    """Every container uid range this node's records name, live or finished (workers' too)."""
    bases: set[int] = set()
    if not db.exists():
        return bases
    with contextlib.suppress(sqlite3.Error), contextlib.closing(_ro(db)) as conn:
        for (runtime,) in conn.execute("SELECT runtime FROM sandboxes"):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                rt = json.loads(runtime)
                worker = rt.get("worker")
                for base in (
                    rt.get("uid_base"),
                    worker.get("runtime", {}).get("uid_base") if isinstance(worker, dict) else None,
                ):
                    if isinstance(base, int):
                        bases.add(base)
    return bases


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def process(prefix: str, pid: int | None) -> Counters:
    """Open fds, threads and resident memory (KiB) of one process; -1 each if it is gone."""
    if pid is None:
        return {f"{prefix}.fds": -1, f"{prefix}.threads": -1, f"{prefix}.rss_kib": -1}
    try:
        status = _status(pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {f"{prefix}.fds": -1, f"{prefix}.threads": -1, f"{prefix}.rss_kib": -1}
    rss = int(status.get("VmRSS", "0 kB").split()[0])
    out = {f"{prefix}.fds": fds, f"{prefix}.threads": int(status["Threads"]), f"{prefix}.rss_kib": rss}
    return out | {f"{prefix}.fd.{k}": n for k, n in fd_kinds(pid).items()}


def fd_kinds(pid: int) -> Counter[str]:
    """A process's open fds by what they are: socket, pipe, anon (eventfd, pidfd, epoll...), a namespace
    (``ns_user``, ``ns_net``...), a device, or a file."""
    kinds: Counter[str] = Counter(dict.fromkeys(("socket", "pipe", "anon", "ns_user", "dev", "file"), 0))
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                head = target.split(":", 1)[0]
                if head in ("socket", "pipe"):
                    kinds[head] += 1
                elif head == "anon_inode":
                    kinds["anon"] += 1
                elif target.startswith("/"):
                    kinds["dev" if target.startswith("/dev/") else "file"] += 1
                else:  # "user:[4026532...]": a namespace held open
                    kinds[f"ns_{head}"] += 1
    return kinds


def _cgroup_owner(pid: str) -> str | None:
    """The dsec group a process is in (its sandbox or VMM's name), from its unified cgroup line."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::/dsec/"):
            parts = line[len("0::/dsec/") :].split("/")
            if parts[0] == "vmm":
                return parts[1].rsplit(".", 1)[0] if len(parts) > 1 else None
            return parts[0]
    return None


def processes(node: Node, known: Known) -> Counters:
    """One pass over /proc: this node's sandbox processes (by cgroup), its QEMUs, the daemon's children
    and zombies, and the network namespaces its sandboxes and processes hold."""
    out: Counter[str] = Counter(dict.fromkeys(("qemu.processes", "daemon.children", "daemon.zombies"), 0))
    out["sandbox.processes"] = 0
    netns: set[str] = set()
    daemon = str(node.daemon_pid)
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            with open(f"/proc/{e.name}/stat", encoding="utf-8", errors="replace") as f:
                head, _, rest = f.read().rpartition(")")
            comm, fields = head.partition("(")[2], rest.split()
        except OSError:
            continue
        state, ppid = fields[0], fields[1]
        owner = _cgroup_owner(e.name)
        ours = owner is not None and known.owns(owner)
        if comm == QEMU_COMM:
            out["host.qemu"] += 1
            out["qemu.processes"] += ours or ppid == daemon
        if ppid == daemon:
            out["daemon.children"] += 1
            out["daemon.zombies"] += state == "Z"
        if ours:
            out["sandbox.processes"] += 1
            with contextlib.suppress(OSError):
                netns.add(os.readlink(f"/proc/{e.name}/ns/net"))
    for pid in (node.daemon_pid, node.fetcher_pid):
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd.path)).startswith("net:["):
                        netns.add(target)
    out["net.namespaces"] = len(netns)
    return dict(out)


def network(node: Node, known: Known) -> Counters:
    """Named network namespaces (host-wide: dsec names none), this node's sandbox interfaces (veths
    and taps) and their host-wide address leases, and the objects of its nftables table."""
    names = {nft.ifname(i) for i in known.ids if i.startswith("sb-")}
    names |= {_template_tap(i) for i in known.ids if i.startswith(node.template_prefix)}
    out: Counter[str] = Counter({"net.interfaces": 0, "net.address_leases": 0})
    with contextlib.suppress(OSError):
        out["host.netns_named"] = len(os.listdir(NETNS_DIR))
    with contextlib.suppress(OSError):
        for e in os.scandir("/sys/class/net"):
            if e.name.startswith(nft.IFACE_PREFIX):
                out["host.sandbox_interfaces"] += 1
                out["net.interfaces"] += e.name in names
    label = "lo:" + node.table.removeprefix("dsec_")
    with contextlib.suppress(OSError):
        for e in os.scandir(ADDRESS_LEASES):
            with contextlib.suppress(OSError):
                owner = os.readlink(e.path)
                out["host.address_leases"] += 1
                out["net.address_leases"] += owner in names or owner == label
    out.update(nft_objects(node.table))
    return dict(out)


def _template_tap(vm_name: str) -> str:
    return nft.IFACE_PREFIX + "t" + hashlib.sha256(vm_name.encode()).hexdigest()[:12]


def nft_objects(table: str) -> Counters:
    """Chains, rules, sets, maps, counters and the elements of every set and map of the node's table
    (all zero while the table does not exist)."""
    out = dict.fromkeys(("nft.tables", "nft.chains", "nft.rules", "nft.sets", "nft.maps", "nft.counters"), 0)
    out["nft.elements"] = 0
    try:
        proc = subprocess.run(
            ["nft", "-j", "list", "table", "inet", table], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return out
    if proc.returncode != 0:
        return out  # no such table (nothing on the network yet, or it was dropped)
    for item in json.loads(proc.stdout).get("nftables", []):
        for kind in ("table", "chain", "rule", "set", "map", "counter"):
            if kind in item:
                out[f"nft.{kind}s"] += 1
                if kind in ("set", "map"):
                    out["nft.elements"] += len(item[kind].get("elem", []))
    return out


def sqlite_rows(state_dir: Path) -> Counters:
    """Rows of every table of the node's databases; sandbox records split into live and finished."""
    out: Counters = {}
    for db in sorted(state_dir.glob("*.db")):
        with contextlib.suppress(sqlite3.Error), contextlib.closing(_ro(db)) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for t in tables:
                if t.startswith("sqlite_"):
                    continue
                (rows,) = conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()
                out[f"sqlite.{db.stem}.{t}"] = rows
                if t == "sandboxes":
                    marks = ",".join("?" * len(LIVE_STATES))
                    query = f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({marks})"
                    (live,) = conn.execute(query, LIVE_STATES).fetchone()
                    out[f"sqlite.{db.stem}.{t}"] = live
                    out[f"sqlite.{db.stem}.{t}_finished"] = rows - live
    return out


def _tree(path: Path) -> tuple[int, int]:
    """Files and bytes below ``path``, not crossing into other file systems (mounted layers, rootfs)."""
    files = size = 0
    try:
        dev = path.stat().st_dev
    except OSError:
        return 0, 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if _same_dev(Path(dirpath) / d, dev)]
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(Path(dirpath) / name)
                files += 1
                size += st.st_blocks * 512
    return files, size


def _same_dev(path: Path, dev: int) -> bool:
    try:
        return os.lstat(path).st_dev == dev
    except OSError:
        return False


def _entries(path: Path, pattern: str = "*") -> int:
    return sum(1 for _ in path.glob(pattern)) if path.is_dir() else 0


def files(state_dir: Path) -> Counters:
    """Bundles, temporary files and caches in the state dir, and the temporary files dsec makes in /tmp."""
    out: Counters = {
        "files.sandbox_bundles": _entries(state_dir / "sandboxes"),
        "files.vm_bundles": _entries(state_dir / "vms", "sb-*"),
        "files.vm_fork_memory": _entries(state_dir / "vms", "fork-*"),
        "files.runtime_states": _entries(state_dir / "run" / "crun"),
        "files.image_tmp": _entries(state_dir / "images" / "tmp"),
        "files.state_tmp": _entries(state_dir, "tmp*") + _entries(state_dir, "*.tmp"),
        "host.tmp_dsec": sum(_entries(Path("/tmp"), f"{p}*") for p in HOST_TMP_PREFIXES),
    }
    out["cache.layer_chunks"], out["cache.layer_bytes"] = _tree(state_dir / "images" / "fetcher" / "cache")
    out["cache.layer_blobs"], out["cache.layer_blob_bytes"] = _tree(state_dir / "images" / "blobs")
    out["cache.layer_mountpoints"] = _entries(state_dir / "images" / "mnt")
    out["cache.vm_templates"], out["cache.vm_template_bytes"] = _tree(state_dir / "vm-templates")
    return out


def snapshot(node: Node, known: Known) -> Counters:
    """Every counter of the node at this moment (``known`` is scanned first)."""
    known.scan()
    out: Counters = {}
    out.update(mounts(node))
    out.update(cgroups(known))
    out.update(uid_leases(known))
    out.update(process("daemon", node.daemon_pid))
    out.update(process("fetcher", node.fetcher_pid))
    out.update(processes(node, known))
    out.update(network(node, known))
    out.update(sqlite_rows(node.state_dir))
    out.update(files(node.state_dir))
    return dict(sorted(out.items()))


# ---- the diff -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allowance:
    """How far a counter may end above its baseline without being a leak, and why."""

    why: str
    slack: int = 0  # absolute
    ratio: float = 0.0  # of the baseline
    cap: int | None = None  # instead: any value up to this bound (a cache bounded by configuration)
    retained: bool = False  # instead: any growth, reported as retained (history kept by a retention rule)
    bound: str | None = None  # instead: up to ``per`` times another counter's value after
    per: int = 1
    follows: str | None = None  # instead: may grow as much as another counter grew within its allowance
    plus: str | None = None  # and further, by as much as another counter grew (memory it reports holding)
    trend: int | None = None  # on a long run, instead: its growth over the run's last part, KiB per hour at most

    def limit(self, name: str, before: Mapping[str, int], after: Mapping[str, int]) -> int | None:
        b = before.get(name, 0)
        if self.retained:
            return None
        if self.cap is not None:
            return max(self.cap, b)
        if self.bound is not None:
            return max(self.per * after.get(self.bound, 0), b)
        if self.follows is not None:
            return b + max(0, after.get(self.follows, 0) - before.get(self.follows, 0))
        grown = max(0, after.get(self.plus, 0) - before.get(self.plus, 0)) if self.plus is not None else 0
        return b + max(self.slack, int(b * self.ratio)) + grown


EXACT = Allowance("must return to its baseline")


def diff(
    before: Mapping[str, int],
    after: Mapping[str, int],
    allowances: Mapping[str, Allowance],
    trends: Mapping[str, float] | None = None,
) -> list[Any]:
    """One row per counter: its baseline, its value after, the bound it is judged by and the verdict:
    ``ok``, ``retained`` (grew under a retention rule), ``leak``, or ``info`` (host-wide, not judged).
    A counter missing on one side counts as 0 there; one gone below its baseline is ``ok``. A counter
    with a trend rule and a measured trend (``trends``, per hour) is judged by that instead: its row's
    ``limit`` is then the rate allowed and ``trend_per_h`` the rate seen."""
    rows = []
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, 0), after.get(name, 0)
        rule = allowances.get(name, EXACT)
        seen = trends.get(name) if trends is not None and rule.trend is not None else None
        limit = rule.trend if seen is not None else rule.limit(name, before, after)
        row: dict[str, Any] = {"counter": name, "before": b, "after": a, "delta": a - b, "limit": limit}
        if name.startswith("host."):
            verdict = "info"
        elif seen is not None:
            verdict = "ok" if seen <= (limit or 0) else "leak"
            row["trend_per_h"] = seen
        elif limit is None:
            verdict = "retained" if a > b else "ok"
        else:
            verdict = "ok" if a <= limit else "leak"
        rows.append(row | {"verdict": verdict})
    return rows


def leaks(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    return [str(r["counter"]) for r in rows if r["verdict"] == "leak"]
