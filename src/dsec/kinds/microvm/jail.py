"""The VMM jail: what each QEMU process runs inside (a guest that escapes into QEMU lands here).

- **Its own unprivileged user**: a uid (= gid) per VM from a range no container sandbox is ever given
  (the top range of :mod:`dsec.isolation.idmap`'s slots, which :class:`UidSlots` never hands out), no
  supplementary groups, no capabilities (bounding set empty too), ``no_new_privs``. A uid per VM, not one
  shared ``dsec-vmm`` user: processes of one uid may signal each other and read each other's memory
  (``process_vm_readv``), so two escaped guests must not share one. Uids are leased host-wide in
  ``/run/dsec/vmm`` (several daemons share the host); a QEMU owns no file anywhere, so a uid whose VM is
  gone can be handed to the next one.
- **Its own cgroup** ``dsec/vmm/<key>`` with memory (guest + :func:`overhead_mib`), CPU (a quota of its
  vCPUs) and pids limits; on a hybrid host the limits live in the v1 hierarchies and the v2 group is for
  grouping and ``cgroup.kill``.
- **Its own mount namespace**: a read-only tmpfs root holding only ``/usr``, the loader's links, the
  guest's kernel, initramfs, helper disk and layer files (read-only binds at their host paths), and
  ``/dev/null``, ``/dev/urandom`` (``/dev/kvm`` under KVM, owned by the VM's uid). No ``/proc``, no
  ``/sys``, nothing of the daemon's state dir but the layer files.
- **Its own network namespace** (loopback only, down; QEMU has no NICs), IPC, UTS and cgroup namespaces.
- QEMU's own seccomp filter (``-sandbox on``) on top.

The daemon binds the console, agent and QMP sockets itself (in the VM's bundle, as before) and hands
them to QEMU as listening fds: QEMU needs no writable directory at all, and nothing the VMM could do
can plant a symlink where the daemon later opens a file.

:func:`release` (idempotent) kills what is left in the VM's cgroup, removes it and frees the uid.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from ...isolation import cgroups, idmap

# The one slot-sized range idmap.UidSlots never hands out (slots stop at MAX_SLOTS - 1), so container
# sandboxes' ranges and VMM uids stay disjoint if either changes. (uid_t)-1 is not a uid.
UID_BASE = idmap.base_of(idmap.MAX_SLOTS)
UID_COUNT = min(idmap.RANGE, (1 << 32) - 1 - UID_BASE)
LEASES = Path("/run/dsec/vmm")
LEASE_GRACE_S = 60.0  # a lease this young may belong to a VM still starting: never reclaimed

CGROUP_PARENT = "dsec/vmm"
CPU_PERIOD_US = 100_000
# QEMU's threads: main loop, RCU, one per vCPU, and a block-I/O worker pool of up to 64; a thread bomb
# in a compromised QEMU stops here.
PIDS_MAX = 128
# QEMU's own memory beyond the guest's RAM. Measured here (QEMU 7.2 TCG, microvm, busybox image, 256 MiB
# guest filled until its RAM was all in use): the cgroup was charged 360 MiB, of which 63 MiB translated
# code and ~41 MiB QEMU's heap, device state and thread stacks. The translated code is capped by
# ``-accel tcg,tb-size`` (set by qemu.argv; QEMU's default is 1 GiB, resident as it fills); the rest
# gets three times what was measured. Page cache of the disk files is charged too, but reclaimed at
# the limit instead of killing QEMU.
BASE_OVERHEAD_MIB = 128
TCG_TB_MIB = 128

# fixed numbers: the character devices' ABI
NULL_DEV = (1, 3)
URANDOM_DEV = (1, 9)
KVM_DEV = (10, 232)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def overhead_mib(accel: str) -> int:
    return BASE_OVERHEAD_MIB + (TCG_TB_MIB if accel == "tcg" else 0)


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_quota_us: int
    cpu_period_us: int
    pids: int
    cpu_shares: int = 1024  # v1 cpu.shares; v2 cpu.weight is derived from it the way crun derives it

    @property
    def cpu_weight(self) -> int:
        return 1 + ((self.cpu_shares - 2) * 9999) // 262142


def limits(memory_mib: int, cpus: int, accel: str, cpu_request: float = 1.0) -> Limits:
    return Limits(
        memory_bytes=(memory_mib + overhead_mib(accel)) << 20,
        cpu_quota_us=cpus * CPU_PERIOD_US,
        cpu_period_us=CPU_PERIOD_US,
        pids=PIDS_MAX,
        cpu_shares=max(2, min(262144, int(cpu_request * 1024))),
    )


def key(name: str, bundle: Path) -> str:
    """The VM's jail identity: its name plus where it lives (two daemons may run VMs of one name)."""
    if not _NAME.match(name):
        raise BackendError(f"invalid VM name {name!r}")
    return f"{name}.{hashlib.sha256(os.fsencode(os.path.abspath(bundle))).hexdigest()[:10]}"


# ---- uids ----------------------------------------------------------------------------------------


def _leases(root: Path) -> tuple[Path, Path]:
    by_key, by_uid = root / "by-key", root / "by-uid"
    for d in (root, by_key, by_uid):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700, parents=True)
    return by_key, by_uid


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _stale(by_key: Path, by_uid: Path, uid: int, owner: str) -> bool:
    """Whether the lease of ``uid`` by ``owner`` outlived its VM (a daemon that died before releasing)."""
    try:
        if time.time() - os.lstat(by_uid / str(uid)).st_mtime < LEASE_GRACE_S:
            return False
    except FileNotFoundError:
        return True
    if _readlink(by_key / owner) != str(uid):
        return True
    return not _populated(unified_dir(owner))


def _probe_start(vm_key: str) -> int:
    # spread over the range: concurrent daemons rarely probe the same uids
    return int.from_bytes(hashlib.sha256(vm_key.encode()).digest()[:8], "big") % UID_COUNT


def lease_uid(vm_key: str, root: Path = LEASES) -> int:
    """The VM's uid: its existing lease, or a free one (probing from a hash of the key)."""
    by_key, by_uid = _leases(root)
    held = _readlink(by_key / vm_key)
    if held is not None and held.isdigit() and _readlink(by_uid / held) == vm_key:
        # young again: a VM starting under it must not look stale to another daemon (or to sweep)
        for link in (by_uid / held, by_key / vm_key):
            os.utime(link, follow_symlinks=False)
        return int(held)
    start = _probe_start(vm_key)
    for i in range(UID_COUNT):
        uid = UID_BASE + (start + i) % UID_COUNT
        for _ in range(2):
            try:
                # symlink creation is atomic: the first daemon to name this uid owns it
                os.symlink(vm_key, by_uid / str(uid))
            except FileExistsError:
                owner = _readlink(by_uid / str(uid))
                if owner is None or not _stale(by_key, by_uid, uid, owner):
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(by_uid / str(uid))
                if _readlink(by_key / owner) == str(uid):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(by_key / owner)
                continue
            tmp = by_key / f".{vm_key}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(str(uid), tmp)
            os.replace(tmp, by_key / vm_key)
            return uid
    raise BackendError(f"no free VMM uid left ({UID_COUNT} in use)")


def drop_uid(vm_key: str, root: Path = LEASES) -> None:
    by_key, by_uid = root / "by-key", root / "by-uid"
    held = _readlink(by_key / vm_key)
    if held is not None and _readlink(by_uid / held) == vm_key:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(by_uid / held)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(by_key / vm_key)


# ---- cgroups -------------------------------------------------------------------------------------


@functools.cache
def layout() -> cgroups.CgroupLayout:
    return cgroups.detect()


def _populated(group: Path) -> bool:
    try:
        for line in (group / "cgroup.events").read_text().splitlines():
            if line.startswith("populated "):
                return line.split()[1] == "1"
    except OSError:
        pass
    return False


def running(vm_key: str) -> bool:
    """Whether a process of this VM is alive in its cgroup."""
    return _populated(unified_dir(vm_key))


def v1_dirs(vm_key: str) -> dict[str, Path]:
    """The VM's groups in the v1 hierarchies that hold its limits (hybrid hosts), by controller."""
    out: dict[str, Path] = {}
    if layout().mode == "hybrid":
        for ctrl in ("memory", "cpu", "pids"):
            hier = cgroups.CGROUP_ROOT / ctrl
            if (hier / "cgroup.procs").exists():
                out[ctrl] = hier / CGROUP_PARENT / vm_key
    return out


def unified_dir(vm_key: str) -> Path:
    return layout().unified / CGROUP_PARENT / vm_key


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _enable_v2_controllers(unified: Path, wanted: Iterable[str]) -> None:
    """Turn the controllers on down to ``dsec/vmm`` (each level hands them to the next)."""
    available = set((unified / "cgroup.controllers").read_text().split())
    d = unified
    for part in ("", *CGROUP_PARENT.split("/")):
        d = d / part if part else d
        d.mkdir(exist_ok=True)
        enabled = set((d / "cgroup.subtree_control").read_text().split())
        for ctrl in wanted:
            if ctrl in available and ctrl not in enabled:
                _write(d / "cgroup.subtree_control", f"+{ctrl}")


def make_cgroup(vm_key: str, lim: Limits) -> list[Path]:
    """Create the VM's cgroups with its limits; returns the directories its process must join."""
    lay = layout()
    unified = unified_dir(vm_key)
    if lay.mode == "v2":
        _enable_v2_controllers(lay.unified, ("memory", "cpu", "pids"))
    unified.mkdir(parents=True, exist_ok=True)
    os.utime(unified)  # a reused group is young again until its VM joins it (see sweep)
    joined = [unified]
    if lay.mode == "v2":
        _write(unified / "memory.max", str(lim.memory_bytes))
        if (unified / "memory.swap.max").exists():
            _write(unified / "memory.swap.max", "0")
        _write(unified / "cpu.max", f"{lim.cpu_quota_us} {lim.cpu_period_us}")
        _write(unified / "cpu.weight", str(lim.cpu_weight))
        _write(unified / "pids.max", str(lim.pids))
        return joined
    for ctrl, d in v1_dirs(vm_key).items():
        d.mkdir(parents=True, exist_ok=True)
        if ctrl == "memory":
            _write(d / "memory.limit_in_bytes", str(lim.memory_bytes))
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", str(lim.memory_bytes))  # no swapping out past it
        elif ctrl == "cpu":
            _write(d / "cpu.cfs_period_us", str(lim.cpu_period_us))
            _write(d / "cpu.cfs_quota_us", str(lim.cpu_quota_us))
            _write(d / "cpu.shares", str(lim.cpu_shares))
        else:
            _write(d / "pids.max", str(lim.pids))
        joined.append(d)
    return joined


def remove_cgroup(vm_key: str, timeout: float = 5.0, kill: bool = True) -> bool:
    """Kill what is left in the VM's cgroup (unless ``kill`` is false) and remove it; False if it would
    not go within ``timeout`` (a group with a live process in it cannot be removed)."""
    groups = [unified_dir(vm_key), *v1_dirs(vm_key).values()]
    if kill and any(g.exists() for g in groups):
        cgroups.kill_group(groups[0])
    deadline = time.monotonic() + timeout
    while True:
        # a dying QEMU leaves its cgroups only once its memory is torn down: rmdir fails (EBUSY) until then
        if all(cgroups.remove_group(g) for g in groups):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


# ---- the mount plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    path: str
    major: int
    minor: int
    mode: int
    vmm_owned: bool  # owned by the VM's uid (its /dev/kvm), else root's


@dataclass(frozen=True)
class Plan:
    binds: tuple[tuple[str, bool], ...]  # (host path, executable), bound read-only at the same path
    links: tuple[tuple[str, str], ...]  # (path, target)
    devices: tuple[Device, ...]


LOADER_ROOTS = ("/lib", "/lib64")  # where the dynamic loader and libraries live besides /usr
EXTRA = ("/etc/ld.so.cache",)  # read-only extras when the host has them (the loader finds libraries faster)


def host_roots(paths: Sequence[str] = LOADER_ROOTS) -> dict[str, str | None]:
    """How the host has each of ``paths``: a symlink's target, None for a directory; absent ones left out."""
    out: dict[str, str | None] = {}
    for p in paths:
        if os.path.islink(p):
            out[p] = os.readlink(p)
        elif os.path.isdir(p):
            out[p] = None
    return out


def _norm(path: str | Path) -> str:
    return os.path.normpath(os.path.abspath(path))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def plan(
    binary: str, files: Iterable[str | Path], accel: str, roots: Mapping[str, str | None], extra: Iterable[str]
) -> Plan:
    """What the VMM's root holds: ``/usr`` and the loader roots (executable), then ``files`` (the guest's
    kernel, initramfs and disks) and ``extra`` read-only, each once and only where nothing above covers it."""
    binds: list[tuple[str, bool]] = [("/usr", True)]
    links: list[tuple[str, str]] = []
    for p, target in roots.items():
        if target is None:
            binds.append((_norm(p), True))
        else:
            links.append((_norm(p), target))
    qemu = _norm(binary)
    covered = [b for b, _ in binds] + [lk for lk, _ in links]
    if not any(_under(qemu, c) for c in covered):
        binds.append((qemu, True))
        covered.append(qemu)
    for f in (*extra, *files):
        path = _norm(f)
        if any(_under(path, c) for c in covered):
            continue
        binds.append((path, False))
        covered.append(path)
    devices = [Device("/dev/null", *NULL_DEV, 0o666, False), Device("/dev/urandom", *URANDOM_DEV, 0o666, False)]
    if accel == "kvm":
        devices.append(Device("/dev/kvm", *KVM_DEV, 0o600, True))
    return Plan(tuple(binds), tuple(links), tuple(devices))


def launcher_argv(
    launcher: Path, p: Plan, root: Path, uid: int, cgroup_dirs: Sequence[Path], qemu_argv: Sequence[str]
) -> list[str]:
    args = [str(launcher), "--root", _norm(root), "--uid", str(uid), "--gid", str(uid)]
    for d in cgroup_dirs:
        args += ["--cgroup", str(d)]
    for path, executable in p.binds:
        args += ["--ro-exec" if executable else "--ro", path]
    for path, target in p.links:
        args += ["--link", path, target]
    for dev in p.devices:
        owner = "1" if dev.vmm_owned else "0"
        args += ["--dev", dev.path, str(dev.major), str(dev.minor), f"0{dev.mode:o}", owner]
    return [*args, "--", *qemu_argv]


def existing(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def sweep(now: float | None = None) -> list[str]:
    """Remove what VMs left behind without a :func:`release` (their daemon died, or never called it):
    empty cgroups and leases without a cgroup, once older than the grace period. Returns the keys swept.

    A VM that is starting is younger than the grace period; one that runs keeps its cgroup populated.
    """
    now = time.time() if now is None else now
    swept: list[str] = []
    parent = layout().unified / CGROUP_PARENT
    for d in sorted(parent.iterdir()) if parent.is_dir() else []:
        try:
            if not d.is_dir() or _populated(d) or now - d.stat().st_mtime < LEASE_GRACE_S:
                continue
        except FileNotFoundError:
            continue
        # no kill: should a VM have joined the group since it was looked at, the rmdir fails instead
        if remove_cgroup(d.name, timeout=0, kill=False):
            drop_uid(d.name)
            swept.append(d.name)
    by_key = LEASES / "by-key"
    for lease in sorted(by_key.iterdir()) if by_key.is_dir() else []:
        try:
            old = now - os.lstat(lease).st_mtime >= LEASE_GRACE_S
        except FileNotFoundError:
            continue
        if old and lease.name.startswith("."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lease)  # a half-made lease of a daemon that died in lease_uid
        elif old and not unified_dir(lease.name).exists():
            drop_uid(lease.name)
            swept.append(lease.name)
    return swept


def release(vm_key: str) -> bool:
    """Kill what is left of the VM's QEMU, remove its cgroups, free its uid. Idempotent; False if the
    cgroups could not be removed (the uid is then kept, so it is not handed to another VM too early)."""
    if not remove_cgroup(vm_key):
        return False
    drop_uid(vm_key)
    return True
