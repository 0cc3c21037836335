"""The microvm kind: real QEMU guests (TCG here), so few of them, each doing several checks."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, qemu_pid, require_kind


@pytest.fixture(scope="module")
def vm(daemon: Daemon) -> Iterator[dsec.Sandbox]:
    require_kind(daemon.client(), "microvm")
    sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=daemon.client(), memory="256Mi")
    yield sb
    sb.kill()


def test_a_microvm_is_its_own_machine(vm: dsec.Sandbox, daemon: Daemon) -> None:
    info = vm.info()
    assert info.kind == "microvm" and info.accelerator in ("kvm", "tcg")
    res = vm.exec("cat /proc/1/comm; uname -r; ls /.dsec; grep -c processor /proc/cpuinfo")
    lines = res.stdout.split()
    assert lines[0] == "agent" and lines[1] != os.uname().release  # the guest's own kernel and init
    marker = Path("/tmp") / f"host-only-{vm.id}"
    marker.write_text("host")
    try:
        assert vm.exec(f"cat {marker}").exit_code != 0  # host files are not in the guest
    finally:
        marker.unlink()
    # the agent and busybox come from a read-only disk: the workload cannot replace them
    denied = vm.exec("echo x > /.dsec/agent")
    assert denied.exit_code != 0 and "Read-only" in denied.stderr
    # the only disks are its own image's layers and the helper, all read-only: no other VM's, no host's
    disks = vm.exec("for d in /sys/block/vd*; do echo $(cat $d/serial) $(cat $d/ro); done").stdout.split("\n")
    assert sorted(d for d in disks if d) == ["dsec-helper 1", "dsec-l0 1"]
    assert vm.exec("echo x > /dev/vda").exit_code != 0


def test_console_flood_is_capped(vm: dsec.Sandbox, daemon: Daemon) -> None:
    vm.exec("head -c 5000000 /dev/zero | tr '\\0' x > /dev/console", timeout=120)
    time.sleep(1)
    bundle = daemon.state_dir / "vms" / vm.id
    sizes = [p.stat().st_size for p in bundle.glob("console.log*")]
    assert sizes and all(s <= 1 << 20 for s in sizes) and sum(sizes) <= 2 << 20


def test_killing_qemu_from_outside_fails_the_sandbox(daemon: Daemon) -> None:
    client = daemon.client()
    require_kind(client, "microvm")
    sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=client, memory="256Mi")
    try:
        os.kill(qemu_pid(sb.id), signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(dsec.SandboxGone):
            sb.exec("true")
        info = sb.info()
        assert info.state == dsec.State.failed and "QEMU" in (info.reason or "")
    finally:
        sb.kill()


def test_restored_vms_start_fast_with_their_own_clock_and_randomness(daemon: Daemon) -> None:
    client = daemon.client()
    require_kind(client, "microvm")
    first = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=client, memory="192Mi")
    first.kill()
    # the first VM of this shape boots; a template is saved in the background for the next ones
    restored: list[dsec.Sandbox] = []
    try:
        deadline = time.monotonic() + 120
        while len(restored) < 2 and time.monotonic() < deadline:
            sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=client, memory="192Mi")
            if sb.info().started_from == "snapshot":
                restored.append(sb)
            else:
                sb.kill()
                time.sleep(2)
        assert len(restored) == 2, "no VM was restored from a template within 2 minutes"
        outputs = [sb.exec("head -c 16 /dev/urandom | od -An -tx1; date +%s").stdout.split("\n") for sb in restored]
        assert outputs[0][0] != outputs[1][0]  # no shared CRNG state
        for out in outputs:
            assert abs(int(out[1]) - time.time()) < 10  # the clock is the host's, not the template's
    finally:
        for sb in restored:
            sb.kill()
