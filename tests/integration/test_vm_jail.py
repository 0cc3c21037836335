"""The VMM jail, checked from the host on one real microVM: QEMU's user, capabilities, seccomp, cgroup
limits, mount and network namespaces, and that the cgroup goes with the VM."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dsec
from dsec.kinds.microvm import jail

from .conftest import Daemon, qemu_pid, require_kind


@dataclass
class VM:
    sb: dsec.Sandbox
    pid: int
    bundle: Path
    key: str


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _arg(pid: int, flag: str) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def vm(daemon: Daemon) -> Iterator[VM]:
    require_kind(daemon.client(), "microvm")
    sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=daemon.client(), memory="256Mi")
    try:
        bundle = daemon.state_dir / "vms" / sb.id
        yield VM(sb, qemu_pid(sb.id), bundle, jail.key(sb.id, bundle))
    finally:
        sb.kill()


def test_qemu_is_an_unprivileged_user_of_its_own(vm: VM) -> None:
    st = _status(vm.pid)
    uids, gids = {int(x) for x in st["Uid"].split()}, {int(x) for x in st["Gid"].split()}
    assert len(uids) == 1 and uids == gids  # real, effective, saved and filesystem ids alike
    uid = uids.pop()
    assert uid != 0 and jail.UID_BASE <= uid < jail.UID_BASE + jail.UID_COUNT
    assert os.readlink(jail.LEASES / "by-key" / vm.key) == str(uid)  # the uid leased to this VM
    assert st["Groups"] == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[caps], 16) == 0, caps
    assert st["NoNewPrivs"] == "1"
    assert st["Seccomp"] == "2"  # QEMU's -sandbox filter is on
    # the pid the daemon holds is QEMU itself, not a wrapper
    assert Path(f"/proc/{vm.pid}/exe").resolve().name.startswith("qemu-system")


def test_qemu_has_its_own_cgroup_with_limits(vm: VM) -> None:
    lines = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{vm.pid}/cgroup").read_text().splitlines())
    where = f"/{jail.CGROUP_PARENT}/{vm.key}"
    assert lines[""] == where
    memory_mib, cpus = int(_arg(vm.pid, "-m")), int(_arg(vm.pid, "-smp"))
    want = jail.limits(memory_mib, cpus, vm.sb.info().accelerator or "tcg", vm.sb.info().limits.cpu)
    assert want.memory_bytes == (memory_mib + jail.overhead_mib(vm.sb.info().accelerator or "tcg")) << 20
    layout = jail.layout()
    if layout.mode == "v2":
        group = layout.unified / where.lstrip("/")
        assert int((group / "memory.max").read_text()) == want.memory_bytes
        assert (group / "cpu.max").read_text().split() == [str(cpus * 100_000), "100000"]
        assert int((group / "cpu.weight").read_text()) == want.cpu_weight  # follows the cpu request
        assert int((group / "pids.max").read_text()) == jail.PIDS_MAX
    else:
        assert lines["memory"] == lines["cpu"] == lines["pids"] == where
        root = Path("/sys/fs/cgroup")
        assert int((root / "memory" / where.lstrip("/") / "memory.limit_in_bytes").read_text()) == want.memory_bytes
        assert int((root / "cpu" / where.lstrip("/") / "cpu.cfs_quota_us").read_text()) == cpus * 100_000
        assert int((root / "cpu" / where.lstrip("/") / "cpu.cfs_period_us").read_text()) == 100_000
        assert int((root / "cpu" / where.lstrip("/") / "cpu.shares").read_text()) == want.cpu_shares
        assert int((root / "pids" / where.lstrip("/") / "pids.max").read_text()) == jail.PIDS_MAX


def test_qemu_sees_only_what_it_needs(vm: VM, daemon: Daemon) -> None:
    assert os.readlink(f"/proc/{vm.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    root = Path(f"/proc/{vm.pid}/root")
    assert sorted(p.name for p in root.iterdir()) == sorted(["dev", "etc", "lib", "lib64", "usr", *_tops(vm)])
    assert sorted(p.name for p in (root / "dev").iterdir()) == ["null", "urandom"] + (
        ["kvm"] if vm.sb.info().accelerator == "kvm" else []
    )
    state = root / str(daemon.state_dir).lstrip("/")
    for secret in ("token", "state.db", "dsec.sock", "vms", "daemon.log"):
        assert not (state / secret).exists(), secret
    assert not (root / str(vm.bundle).lstrip("/")).exists()  # not even its own bundle
    assert not (root / "proc" / "1").exists() and not (root / "sys").exists()
    with pytest.raises(OSError) as e:
        (root / "planted").write_text("x")
    assert e.value.errno == errno.EROFS
    # what it does see: the guest's disks, read-only at their host paths
    layer = _arg(vm.pid, "-drive").split("file=", 1)[1].split(",", 1)[0]
    assert (root / layer.lstrip("/")).stat().st_size == Path(layer).stat().st_size
    with pytest.raises(OSError) as e:
        open(root / layer.lstrip("/"), "r+b").close()
    assert e.value.errno == errno.EROFS


def _tops(vm: VM) -> list[str]:
    """Top-level directories of the guest's files (the kernel's cache, the image cache), in the jail too."""
    args = Path(f"/proc/{vm.pid}/cmdline").read_bytes().decode().split("\0")
    files = [args[args.index("-kernel") + 1], args[args.index("-initrd") + 1]]
    files += [a.split("file=", 1)[1].split(",", 1)[0] for a in args if a.startswith("id=dsec-")]
    return sorted({f.split("/")[1] for f in files} - {"usr", "lib", "lib64", "etc"})


def test_qemu_has_no_network(vm: VM) -> None:
    assert os.readlink(f"/proc/{vm.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    devices = [line.split(":")[0].strip() for line in Path(f"/proc/{vm.pid}/net/dev").read_text().splitlines()[2:]]
    assert devices == ["lo"]


def test_the_daemon_owns_the_sockets_and_the_vm_works(vm: VM) -> None:
    for name in ("agent.sock", "console.sock", "qmp.sock"):
        st = (vm.bundle / name).lstat()
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    res = vm.sb.exec("echo hello from the jail; cat /proc/meminfo | head -1")
    assert res.exit_code == 0 and "hello from the jail" in res.stdout


def test_killing_the_vm_removes_its_cgroup_and_frees_its_uid(vm: VM) -> None:
    groups = [jail.unified_dir(vm.key), *jail.v1_dirs(vm.key).values()]
    assert all(g.is_dir() for g in groups)
    vm.sb.kill()
    assert not any(g.exists() for g in groups)
    assert not (jail.LEASES / "by-key" / vm.key).exists()
    assert not Path(f"/proc/{vm.pid}").exists() or _status(vm.pid).get("State", "").startswith("Z")


def test_leftovers_of_vms_nobody_released_are_swept() -> None:
    # what a daemon that died between a VM's end and its release leaves: an empty cgroup and a uid lease
    vm_key = f"jail-test-{os.getpid()}.0000000000"
    group = jail.unified_dir(vm_key)
    group.mkdir(parents=True)
    uid = jail.lease_uid(vm_key)
    try:
        assert vm_key not in jail.sweep()  # young: it may be a VM just starting
        old = time.time() - jail.LEASE_GRACE_S - 10
        os.utime(group, (old, old))
        assert vm_key in jail.sweep()
        assert not group.exists()
        assert not (jail.LEASES / "by-key" / vm_key).exists()
        assert not (jail.LEASES / "by-uid" / str(uid)).exists()
    finally:
        jail.release(vm_key)
