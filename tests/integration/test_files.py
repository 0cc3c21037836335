from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec


def test_traversal_and_symlinks_stay_inside(sb: dsec.Sandbox, tmp_path: Path) -> None:
    marker = f"dsec-escape-{os.getpid()}-{id(tmp_path)}"
    host_target = Path("/tmp") / marker
    sb.exec("ln -s / /tmp/rootlink; ln -s /tmp /tmp/tmplink; ln -s ../../../../../../tmp /work-up")
    sb.files.write(f"/tmp/rootlink/tmp/{marker}", b"x")
    sb.files.write(f"/../../../../tmp/{marker}-dots", b"x")
    sb.files.write(f"/work-up/{marker}-rel", b"x")
    assert not host_target.exists()
    assert not Path(f"/tmp/{marker}-dots").exists()
    assert not Path(f"/tmp/{marker}-rel").exists()
    # all three landed inside the sandbox
    listing = sb.exec("ls /tmp").stdout
    assert marker in listing and f"{marker}-dots" in listing and f"{marker}-rel" in listing
    # reading host files through links or .. is impossible: /etc/hostname is the sandbox's
    sb.exec("ln -s /proc/1/root /tmp/procroot")
    assert sb.files.read("/../../etc/hostname") == b"sandbox\n"
    with pytest.raises(dsec.DsecError):
        sb.files.read("/tmp/procroot/etc/hostname")  # magic links are refused


def test_write_beyond_disk_limit(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(disk="8Mi")
    with pytest.raises(dsec.LimitExceeded):
        sb.files.write("/big.bin", b"\0" * (16 << 20))
    res = sb.exec("dd if=/dev/zero of=/fill bs=1M count=32")
    assert res.exit_code != 0 and "No space left" in res.stderr
    sb.exec("rm -f /fill /big.bin")
    sb.files.write("/small", b"ok")
    assert sb.files.read("/small") == b"ok"


def test_proc_and_sys_are_read_as_the_sandbox_sees_them(sb: dsec.Sandbox) -> None:
    """/proc and /sys are not in the root filesystem the host reads: they are read inside the sandbox, as
    its account, so they show its own kernel views (its pid 1, its cgroup limits), never the host's."""
    boot_id = sb.files.read("/proc/sys/kernel/random/boot_id")
    assert boot_id == sb.exec("cat /proc/sys/kernel/random/boot_id").stdout.encode() and len(boot_id) == 37
    init = sb.files.read("/proc/1/cmdline").split(b"\0")[0]
    assert init == sb.exec("tr '\\0' '\\n' < /proc/1/cmdline | head -1").stdout.strip().encode()
    assert sb.files.read("/proc/self/../1/comm") == sb.files.read("/proc/1/comm")
    assert sb.files.read("/proc/1/comm") != Path("/proc/1/comm").read_bytes()  # its pid 1, not the host's
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/proc/no-such-entry")
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/sys/no/such/entry")
