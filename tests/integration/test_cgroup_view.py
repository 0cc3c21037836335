"""What a sandbox sees under /sys/fs/cgroup: its own groups only, with its limits, as a fresh mount in its
cgroup namespace would show them (the JVM and other runtimes size themselves from these files)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import dsec
from dsec.isolation import cgroups
from dsec.isolation.mounts import MS_REMOUNT, mount

from .conftest import scratch_dir, shut_down, start_daemon


def test_the_sandbox_sees_its_own_groups_and_limits(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(memory="96Mi", cpu_limit=0.5)
    other = make_sandbox()
    mounts = sb.exec("grep ' /sys/fs/cgroup' /proc/self/mountinfo").stdout.splitlines()
    assert mounts, "no cgroup file system in the sandbox"
    for line in mounts[1:] if cgroups.detect().mode == "hybrid" else mounts:
        assert line.split()[3] == "/", f"a cgroup mount not rooted at the sandbox's own group: {line}"
        assert " ro," in f" {line.split()[5]},", f"a cgroup mount the sandbox could write to: {line}"
    if cgroups.detect().mode == "hybrid":
        expected = set(cgroups.hierarchies())
        assert set(sb.exec("ls /sys/fs/cgroup").stdout.split()) == expected
        limit = sb.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes").stdout.strip()
        quota = sb.exec("cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us").stdout.strip()
        assert (int(limit), int(quota)) == (96 << 20, 50_000)
        tree = sb.exec("find /sys/fs/cgroup/memory /sys/fs/cgroup/unified -type d").stdout
    else:
        assert sb.exec("cat /sys/fs/cgroup/memory.max").stdout.strip() == str(96 << 20)
        tree = sb.exec("find /sys/fs/cgroup -type d").stdout
    assert other.id not in tree and "dsec" not in tree, "the sandbox sees groups beyond its own"
    procs = "/sys/fs/cgroup/memory/cgroup.procs" if cgroups.detect().mode == "hybrid" else "/sys/fs/cgroup/cgroup.procs"
    assert sb.exec(f"echo 1 > {procs} 2>/dev/null || echo refused").stdout.strip() == "refused"


def test_new_cpusets_start_with_the_parents_cpus(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    """On a v1 cpuset hierarchy the daemon has new groups cloned from /dsec (no per-create write that
    checks every sibling); the sandbox's cpuset is the parent's."""
    parent = cgroups.CGROUP_ROOT / "cpuset" / "dsec"
    if cgroups.detect().mode != "hybrid" or not parent.is_dir():
        assert cgroups.detect().mode == "v2", "a hybrid host without a v1 cpuset hierarchy"
        return
    sb = make_sandbox()
    assert (parent / "cgroup.clone_children").read_text().strip() == "1"
    own = (parent / sb.id / "cpuset.cpus").read_text().strip()
    assert own and own == (parent / "cpuset.cpus").read_text().strip()


def _v2_options() -> list[str] | None:
    with open("/proc/self/mountinfo") as f:
        return cgroups.cgroup2_options(f.read(), str(cgroups.detect().unified))


@pytest.mark.timeout(120)
def test_the_daemon_keeps_cgroup_moves_free_of_grace_period_waits() -> None:
    """Each exec joins a cgroup of its own; without favordynmods the first one after a pause waited out an
    RCU grace period (12-15 ms here), every agent step after its model's answer. A daemon's start
    remounts the v2 hierarchy so (cgroups.favor_dynamic_moves), keeping its other options."""
    unified = cgroups.detect().unified
    options = [o for o in _v2_options() or [] if o != "favordynmods"]
    mount("cgroup2", unified, "cgroup2", MS_REMOUNT, ",".join(options))  # as a fresh host has it
    assert "favordynmods" not in (_v2_options() or [])
    with scratch_dir("dsec-cgopt-") as workdir:
        d = start_daemon(workdir / "state")
        try:
            assert _v2_options() == [*options, "favordynmods"]
            sb = dsec.Sandbox.create(image="dsec/busybox", client=d.client())
            assert sb.exec(["true"]).exit_code == 0
            sb.kill()
        finally:
            shut_down(d)
