"""Every dangerous syscall family of isolation/seccomp.py by raw number, devices, sockets, ioctls.

Arguments are chosen so that a call the kernel *does* run is harmless and answers differently
(EINVAL, EBADF, a descriptor, 0) from a refused one (EPERM, ENOSYS, EACCES): the probe prints the
kernel's own return value and errno. Inside a VM the guest kernel is the boundary and guest root
may run these: there the safe outcome checked is the host side (QEMU still jailed, no NIC, no
host device, the host's own state unchanged).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import dsec

from ..integration.conftest import qemu_pid
from .conftest import CONTAINER_KINDS, HostMarkers, heartbeat, raw, raws
from .test_network import Listener, host_addresses

EPERM, EACCES, ENOSYS = 1, 13, 38
REFUSED = (EPERM, EACCES, ENOSYS)
NEWNS, NEWUSER, NEWPID, NEWNET, SIGCHLD = 0x00020000, 0x10000000, 0x20000000, 0x40000000, 17
AT_FDCWD = -100

# family → (syscall number, arguments), x86_64 numbers
FAMILIES: dict[str, list[tuple[int, tuple[str | int, ...]]]] = {
    "mount": [
        (165, ("s:none", "s:/mnt", "s:tmpfs", 0, 0)),  # mount
        (166, ("s:/mnt", 2)),  # umount2
        (155, ("s:/", "s:/")),  # pivot_root
        (428, (AT_FDCWD, "s:/", 1)),  # open_tree(OPEN_TREE_CLONE)
        (429, (-1, "s:", -1, "s:", 0)),  # move_mount
        (430, ("s:tmpfs", 0)),  # fsopen
        (431, (-1, 0, 0, 0, 0)),  # fsconfig
        (432, (-1, 0, 0)),  # fsmount
        (433, (AT_FDCWD, "s:/", 0)),  # fspick
        (442, (AT_FDCWD, "s:/", 0, 0, 0)),  # mount_setattr
    ],
    "bpf-perf": [(321, (0, "b:128", 128)), (298, ("b:128", 0, -1, -1, 0))],
    "userfaultfd": [(323, (0,))],
    "keyrings": [
        (248, ("s:nosuchtype", "s:x", "s:y", 1, -3)),  # add_key
        (249, ("s:user", "s:dsec-nokey", 0, 0)),  # request_key
        (250, (0, -3, 0)),  # keyctl(GET_KEYRING_ID, session)
    ],
    "kexec-modules": [
        (246, (0, 0, 0, 0xFFFF0000)),  # kexec_load with invalid flags
        (320, (-1, -1, 0, 0, 0xFFFF)),  # kexec_file_load
        (175, ("b:16", 16, "s:")),  # init_module
        (313, (-1, "s:", 0)),  # finit_module
        (176, ("s:dsec_no_such_module", 0)),  # delete_module
    ],
    "file-handles": [(303, (AT_FDCWD, "s:/", "b:128", "b:8", 0)), (304, (AT_FDCWD, "b:128", 0))],
    "namespaces": [(272, (NEWUSER,)), (272, (NEWNS,)), (272, (NEWNET,)), (308, ("f:/proc/self/ns/mnt", 0))],
    "io_uring": [(425, (4, "b:120")), (426, (-1, 0, 0, 0, 0, 0)), (427, (-1, 0, 0, 0))],
    "tracing": [
        (101, (0, 0, 0, 0)),  # ptrace(PTRACE_TRACEME)
        (310, (1, "b:64", 1, "b:64", 1, 0)),  # process_vm_readv
        (311, (1, "b:64", 1, "b:64", 1, 0)),  # process_vm_writev
        (312, (1, 1, 0, 0, 0)),  # kcmp
        (438, (-1, 0, 0)),  # pidfd_getfd
        (440, (-1, 0, 0, 0, 0)),  # process_madvise
    ],
    "fanotify-mount-introspection": [(300, (0, 0)), (457, ("b:32", "b:64", 64, 0)), (458, ("b:32", "b:64", 8, 0))],
    "numa": [
        (237, (0, 0, 0, 0, 0, 0)),  # mbind
        (238, (0, 0, 0)),  # set_mempolicy(MPOL_DEFAULT)
        (239, (0, 0, 0, 0, 0)),  # get_mempolicy
        (256, (0, 0, 0, 0)),  # migrate_pages
        (279, (0, 0, 0, 0, 0, 0)),  # move_pages
    ],
    "secret-memory-remap": [(447, (0,)), (216, (0, 0, 0, 0, 0))],
    "host-wide-state": [
        (169, (0, 0, 0, 0)),  # reboot with a wrong magic
        (164, (0, 0)),  # settimeofday(NULL, NULL)
        (227, (0, 0)),  # clock_settime
        (305, (0, 0)),  # clock_adjtime
        (159, ("b:256",)),  # adjtimex (read-only mode)
        (170, ("s:x", 0)),  # sethostname
        (171, ("s:x", 0)),  # setdomainname
        (163, (0,)),  # acct(NULL)
        (179, (0, 0, 0, 0)),  # quotactl
        (103, (3, "b:64", 64)),  # syslog(READ_ALL): the kernel log
        (153, ()),  # vhangup
        (172, (0,)),  # iopl(0)
        (173, (0x80, 1, 0)),  # ioperm(off)
        (135, (0xFFFFFFFF,)),  # personality(query)
    ],
    "clone-namespace-flags": [
        (56, (NEWUSER | SIGCHLD, 0, 0, 0, 0)),
        (56, (NEWPID | SIGCHLD, 0, 0, 0, 0)),
        (56, (NEWNET | NEWNS | SIGCHLD, 0, 0, 0, 0)),
        (435, (f"q:{NEWUSER},0,0,0,{SIGCHLD}", 64)),  # clone3: flags in memory
        (435, (f"q:{NEWNET | NEWPID},0,0,0,{SIGCHLD}", 64)),
    ],
}


def host_side_intact(kind: str, sb: dsec.Sandbox, qemu_before: int | None) -> None:
    """What a VM attack must leave as it was: the same QEMU, still under its own seccomp filter."""
    assert sb.exec("echo alive").stdout == "alive\n"
    if qemu_before is not None:
        assert qemu_pid(sb.id) == qemu_before
        status = Path(f"/proc/{qemu_before}/status").read_text()
        assert "\nSeccomp:\t2\n" in status and "\nNoNewPrivs:\t1\n" in status


def _qemu(kind: str, sb: dsec.Sandbox) -> int | None:
    return None if kind in CONTAINER_KINDS else qemu_pid(sb.id)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dangerous_syscall_family_refused_by_raw_number(
    family: str, kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    before = _qemu(kind, attacker)
    with heartbeat(neighbour):
        got = raws(attacker, FAMILIES[family])
    answers = dict(zip(FAMILIES[family], got, strict=True))
    if kind in CONTAINER_KINDS:
        allowed = {k: v for k, v in answers.items() if not (v[0] == -1 and v[1] in REFUSED)}
        assert not allowed, f"{family}: the kernel ran {allowed}"
    else:
        attacker.exec("umount /mnt 2>/dev/null; true")
    host_side_intact(kind, attacker, before)


def test_mknod_and_device_access(
    kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox, host_markers: HostMarkers
) -> None:
    script = (
        "ls /dev; mknod /tmp/mem c 1 1; mknod /tmp/kmsg c 1 11; mknod /tmp/sda b 8 0; mknod /tmp/vda b 254 0; "
        "mknod /tmp/loop0 b 7 0; for d in /dev/mem /dev/kmem /dev/port /dev/kmsg /tmp/mem /tmp/kmsg; do "
        "timeout 2 head -c 64 $d >/dev/null 2>&1 && echo READ $d; done; "
        "for d in /tmp/sda /tmp/vda /tmp/loop0 /dev/sda /dev/nvme0n1 /dev/loop0; do "
        f"timeout 5 grep -c -s {host_markers.nonce[:-1]}[{host_markers.nonce[-1]}] $d && echo HOSTBYTES $d; done; "
        "rm -f /tmp/mem /tmp/kmsg /tmp/sda /tmp/vda /tmp/loop0"
    )
    before = _qemu(kind, attacker)
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=60)
    assert "HOSTBYTES" not in res.stdout  # no block device holding the host's files is readable
    if kind in CONTAINER_KINDS:
        assert "READ" not in res.stdout, res.stdout
        assert "Operation not permitted" in res.stderr
        devices = set(attacker.exec("ls /dev").stdout.split())
        assert not devices & {"mem", "kmem", "port", "kmsg", "sda", "vda", "nvme0n1", "loop0", "loop-control"}, devices
    host_side_intact(kind, attacker, before)


def test_raw_packet_and_exotic_sockets(kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    socket_nr = 41
    opens = {
        "packet": (17, 3, 0x0300),  # AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)
        "raw-icmp": (2, 3, 1),  # AF_INET, SOCK_RAW, IPPROTO_ICMP
        "raw-ipv6": (10, 3, 58),
        "alg": (38, 5, 0),  # AF_ALG
        "vsock": (40, 1, 0),  # AF_VSOCK: would reach the host's vsock services
        "key": (15, 3, 2),  # AF_KEY
    }
    before = _qemu(kind, attacker)
    with heartbeat(neighbour):
        got = dict(zip(opens, raws(attacker, [(socket_nr, a) for a in opens.values()]), strict=True))
    if kind in CONTAINER_KINDS:
        assert all(ret == -1 and err in (*REFUSED, 97) for ret, err in got.values()), got
    else:
        # guest root may open raw sockets (the guest kernel is the boundary); what they send meets the
        # host-side policy of the VM's NIC, if it has one: nothing reaches the host (see test_network)
        args = Path(f"/proc/{before}/cmdline").read_bytes().split(b"\0")
        assert not any(b"vhost-vsock" in a for a in args)  # AF_VSOCK leads nowhere either
        lst = Listener()
        try:
            targets = " ".join(a for a in host_addresses() if ":" not in a)
            res = attacker.exec(
                f"ip addr; ip route; for a in {targets}; do ping -c 1 -W 1 $a && echo PONG $a; "
                f"echo x | timeout 2 nc -w 1 $a {lst.port}; echo x | timeout 2 nc -u -w 1 $a {lst.port}; done; true",
                timeout=60,
            )
        finally:
            lst.close()
        assert lst.hits == [], lst.hits  # no address of the host, loopback included, reaches its listener
        # an answer from 127.0.0.0/8 is the sandbox's own loopback (its own namespace or kernel), not the host
        pongs = [line for line in res.stdout.splitlines() if line.startswith("PONG ")]
        assert [p for p in pongs if not p.startswith("PONG 127.")] == [], res.stdout
    host_side_intact(kind, attacker, before)


def test_filesystem_metadata_ioctls_contained(kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    setflags, fifreeze, fithaw, fitrim = 0x40086602, 0xC0045877, 0xC0045878, 0xC0185879
    immutable, append_only = 0x10, 0x20
    attacker.exec("echo data > /tmp/target; mkdir -p /tmp/d")
    before = _qemu(kind, attacker)
    with heartbeat(neighbour):
        calls: dict[str, tuple[str | int, ...]] = {
            "immutable": ("f:/tmp/target", setflags, f"q:{immutable}"),
            "append-only": ("f:/tmp/d", setflags, f"q:{append_only}"),
            "freeze-root": ("f:/", fifreeze, 0),
            "freeze-tmp": ("f:/tmp", fifreeze, 0),
            "trim": ("f:/", fitrim, "q:0,0xffffffffffffffff,0"),
            "thaw-root": ("f:/", fithaw, 0),
            "thaw-tmp": ("f:/tmp", fithaw, 0),
        }
        got = dict(zip(calls, raws(attacker, [(16, a) for a in calls.values()]), strict=True))
    got.pop("thaw-root"), got.pop("thaw-tmp")
    if kind in CONTAINER_KINDS:
        assert all(ret == -1 for ret, _ in got.values()), got
    # whatever the guest kernel allowed, the platform still reads and writes the sandbox and its files
    attacker.files.write("/tmp/after-ioctl", b"written by the platform")
    assert attacker.exec("cat /tmp/after-ioctl").stdout == "written by the platform"
    raw(attacker, 16, "f:/tmp/target", setflags, "q:0")
    raw(attacker, 16, "f:/tmp/d", setflags, "q:0")
    attacker.files.remove("/tmp/target")
    attacker.files.remove("/tmp/after-ioctl")
    host_side_intact(kind, attacker, before)


def _host_sysrq_lines() -> int:
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    return out.lower().count("sysrq")


def test_sysrq_trigger_and_sys_writes_do_not_reach_the_host(
    kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    host = {
        p: Path(p).read_text()
        for p in ("/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/kernel/panic")
    }
    sysrq_before = _host_sysrq_lines()
    script = (
        "echo h > /proc/sysrq-trigger; echo dsec-pwned > /proc/sys/kernel/hostname; "
        "echo 1 > /proc/sys/kernel/panic; echo 3 > /proc/sys/vm/drop_caches; echo pwned > /proc/sys/kernel/domainname; "
        "echo 1 > /sys/kernel/mm/ksm/run; echo offline > /sys/devices/system/cpu/cpu1/online; "
        "echo 0 > /sys/devices/system/cpu/cpu1/online; echo 1 > /sys/module/printk/parameters/time; true"
    )
    before = _qemu(kind, attacker)
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=30)
    assert {p: Path(p).read_text() for p in host} == host
    assert _host_sysrq_lines() == sysrq_before
    assert Path("/sys/devices/system/cpu/cpu1/online").read_text().strip() == "1"
    if kind in CONTAINER_KINDS:
        assert res.stderr.count("Read-only file system") + res.stderr.count("Permission denied") >= 5, res.stderr
    else:
        attacker.exec("echo 1 > /sys/devices/system/cpu/cpu1/online 2>/dev/null; true")
    host_side_intact(kind, attacker, before)
