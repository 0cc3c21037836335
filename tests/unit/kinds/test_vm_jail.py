"""The VMM jail's pure parts: uid range, limits, mount plan, launcher command line, uid leases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.errors import BackendError
from dsec.isolation import idmap
from dsec.kinds.microvm import jail, qemu

MERGED_USR = {"/lib": "usr/lib", "/lib64": "usr/lib64"}


def _spec(tmp_path: Path, accel: str = "tcg") -> qemu.VMSpec:
    return qemu.VMSpec(
        name="sb-0123456789ab",
        machine="microvm",
        accel=accel,
        memory_mib=256,
        cpus=2,
        kernel=Path("/var/cache/dsec/vm/kernel/unpacked/boot/vmlinuz-6.12"),
        initrd=Path("/var/cache/dsec/vm/initrd-abc.gz"),
        helper=Path("/var/cache/dsec/vm/helper-abc.erofs"),
        layers=(Path("/state/images/blobs/aaa"), Path("/state/images/fetcher/mnt/bbb")),
        disk_bytes=1 << 30,
        bundle=tmp_path / "vms" / "sb-0123456789ab",
    )


def test_vmm_uids_are_disjoint_from_every_container_range() -> None:
    last_container_base = idmap.base_of(idmap.MAX_SLOTS - 1)
    assert jail.UID_BASE >= last_container_base + idmap.RANGE
    assert jail.UID_BASE + jail.UID_COUNT <= (1 << 32) - 1  # (uid_t)-1 is never handed out
    assert jail.UID_COUNT >= 60_000
    slots = idmap.UidSlots()
    # the allocator's own bound: it never reaches the VMM range
    assert all(idmap.base_of(s) + idmap.RANGE <= jail.UID_BASE for s in (0, idmap.MAX_SLOTS - 1))
    assert slots.take() < jail.UID_BASE


def test_limits_cover_the_guest_plus_qemu_and_a_quota_per_vcpu() -> None:
    tcg = jail.limits(256, 2, "tcg")
    assert tcg.memory_bytes == (256 + jail.BASE_OVERHEAD_MIB + jail.TCG_TB_MIB) << 20
    assert (tcg.cpu_quota_us, tcg.cpu_period_us) == (200_000, 100_000)
    assert tcg.pids == jail.PIDS_MAX
    assert jail.limits(256, 1, "kvm").memory_bytes == (256 + jail.BASE_OVERHEAD_MIB) << 20


def test_the_vm_cpu_weight_follows_its_request_like_a_containers() -> None:
    assert jail.limits(256, 1, "tcg").cpu_shares == 1024
    quarter = jail.limits(256, 1, "tcg", 0.25)
    assert quarter.cpu_shares == 256
    assert jail.limits(256, 1, "tcg", 0.001).cpu_shares == 2  # the kernel's floor
    # v2: crun's mapping of shares to weight, so a VM and a container of one request weigh the same
    assert jail.limits(256, 1, "tcg").cpu_weight == 39 and quarter.cpu_weight == 10


def test_plan_binds_usr_loader_links_and_the_guest_files_read_only(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    files = (spec.kernel, spec.initrd, spec.helper, *spec.layers)
    p = jail.plan("/usr/bin/qemu-system-x86_64", files, "tcg", MERGED_USR, ["/etc/ld.so.cache"])
    assert p.binds[0] == ("/usr", True)
    assert p.links == (("/lib", "usr/lib"), ("/lib64", "usr/lib64"))
    assert [b for b, executable in p.binds if not executable] == ["/etc/ld.so.cache", *(str(f) for f in files)]
    assert [b for b, executable in p.binds if executable] == ["/usr"]  # the guest's files are never executable
    assert str(spec.bundle) not in {b for b, _ in p.binds}
    assert [d.path for d in p.devices] == ["/dev/null", "/dev/urandom"]
    assert not any(d.vmm_owned for d in p.devices)


def test_plan_skips_what_usr_or_a_loader_link_already_shows_and_duplicates() -> None:
    files = ["/usr/share/qemu/bios.bin", "/lib/x/y", "/a/b/../c", "/a/c", "/lib64x/z"]
    p = jail.plan("/usr/bin/qemu-system-x86_64", files, "tcg", MERGED_USR, [])
    assert [b for b, _ in p.binds] == ["/usr", "/a/c", "/lib64x/z"]


def test_plan_for_split_usr_hosts_and_qemu_outside_usr() -> None:
    p = jail.plan("/opt/qemu/bin/qemu-system-x86_64", [], "tcg", {"/lib": None, "/lib64": None}, [])
    assert p.binds == (("/usr", True), ("/lib", True), ("/lib64", True), ("/opt/qemu/bin/qemu-system-x86_64", True))
    assert p.links == ()


def test_kvm_device_only_under_kvm_and_owned_by_the_vm() -> None:
    assert "/dev/kvm" not in [d.path for d in jail.plan("/usr/bin/q", [], "tcg", {}, []).devices]
    kvm = [d for d in jail.plan("/usr/bin/q", [], "kvm", {}, []).devices if d.path == "/dev/kvm"]
    assert len(kvm) == 1 and kvm[0].vmm_owned and kvm[0].mode == 0o600 and (kvm[0].major, kvm[0].minor) == (10, 232)


def test_launcher_argv_hands_qemu_its_command_after_the_jail(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    p = jail.plan("/usr/bin/qemu-system-x86_64", [spec.kernel], "tcg", MERGED_USR, [])
    groups = [Path("/sys/fs/cgroup/unified/dsec/vmm/k"), Path("/sys/fs/cgroup/memory/dsec/vmm/k")]
    qemu_args = qemu.argv(spec)
    args = jail.launcher_argv(Path("/cache/dsec-vmm-launcher"), p, spec.bundle, 4294901770, groups, qemu_args)
    sep = args.index("--")
    assert args[sep + 1 :] == qemu_args
    head = args[:sep]
    assert head[:7] == [
        "/cache/dsec-vmm-launcher",
        "--root",
        str(spec.bundle),
        "--uid",
        "4294901770",
        "--gid",
        "4294901770",
    ]
    assert head.count("--cgroup") == 2
    assert ["--ro-exec", "/usr"] == head[head.index("--ro-exec") : head.index("--ro-exec") + 2]
    assert ["--ro", str(spec.kernel)] == head[head.index("--ro") : head.index("--ro") + 2]
    assert ["--link", "/lib", "usr/lib"] == head[head.index("--link") : head.index("--link") + 3]
    assert ["--dev", "/dev/null", "1", "3", "0666", "0"] == head[head.index("--dev") : head.index("--dev") + 6]


def test_qemu_gets_its_sockets_as_fds_and_keeps_its_seccomp_and_name(tmp_path: Path) -> None:
    args = qemu.argv(_spec(tmp_path))
    joined = " ".join(args)
    assert str(tmp_path) not in joined  # QEMU is never told where the bundle is
    assert f"socket,id=console,fd={qemu.CONSOLE_FD},server=on,wait=off" in args
    assert f"socket,id=agent,fd={qemu.AGENT_FD},server=on,wait=off" in args
    assert f"socket,id=qmp,fd={qemu.QMP_FD},server=on,wait=off" in args
    assert args[args.index("-sandbox") + 1].startswith("on,")
    assert "spawn=deny" in args[args.index("-sandbox") + 1]
    assert args[args.index("-name") + 1] == "dsec-sb-0123456789ab"
    assert args[args.index("-accel") + 1] == f"tcg,tb-size={jail.TCG_TB_MIB}"
    assert qemu.argv(_spec(tmp_path, "kvm"))[args.index("-accel") + 1] == "kvm"


def test_jail_keys_separate_daemons_and_refuse_odd_names(tmp_path: Path) -> None:
    a = jail.key("tpl-0123", tmp_path / "one" / "build")
    assert a.startswith("tpl-0123.") and a == jail.key("tpl-0123", tmp_path / "one" / "build")
    assert a != jail.key("tpl-0123", tmp_path / "two" / "build")
    for bad in ("", "../x", "a/b", "x" * 65, "-x"):
        with pytest.raises(BackendError):
            jail.key(bad, tmp_path)


def test_uid_leases_are_stable_distinct_and_released(tmp_path: Path) -> None:
    leases = tmp_path / "leases"
    a = jail.lease_uid("vm-a.1", leases)
    b = jail.lease_uid("vm-b.1", leases)
    assert a != b and all(jail.UID_BASE <= u < jail.UID_BASE + jail.UID_COUNT for u in (a, b))
    assert jail.lease_uid("vm-a.1", leases) == a  # the same VM keeps its uid (a daemon restart, a retry)
    jail.drop_uid("vm-a.1", leases)
    jail.drop_uid("vm-a.1", leases)  # idempotent
    assert not (leases / "by-key" / "vm-a.1").exists() and not (leases / "by-uid" / str(a)).exists()
    assert os.readlink(leases / "by-uid" / str(b)) == "vm-b.1"


def test_a_taken_uid_is_skipped_and_a_stale_one_reclaimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leases = tmp_path / "leases"
    first = jail.lease_uid("vm-a.1", leases)
    # another VM whose hash lands on the same uid: it probes on while the first one's lease is young
    monkeypatch.setattr(jail, "_probe_start", lambda key: first - jail.UID_BASE)
    second = jail.lease_uid("vm-b.1", leases)
    assert second == jail.UID_BASE + (first - jail.UID_BASE + 1) % jail.UID_COUNT
    # an old lease whose VM has no live cgroup (its daemon died before releasing) is taken over
    old = os.lstat(leases / "by-uid" / str(first)).st_mtime - jail.LEASE_GRACE_S - 5
    os.utime(leases / "by-uid" / str(first), (old, old), follow_symlinks=False)
    monkeypatch.setattr(jail, "_populated", lambda group: False)
    assert jail.lease_uid("vm-c.1", leases) == first
    assert not (leases / "by-key" / "vm-a.1").exists()
