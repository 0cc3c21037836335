"""Faults of real micro-VMs: a guest that stops answering, a kernel panic, a daemon killed under a
running VM. The host finds out by itself, within the timeout, with a reason."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

import dsec
from dsec.kinds.microvm import snapshots

from .conftest import Daemon, require_kind, shut_down, start_daemon


def _vm(client: dsec.Client) -> dsec.Sandbox:
    require_kind(client, "microvm")
    return dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=client, memory="192Mi")


def test_a_guest_that_stops_answering_is_killed(daemon: Daemon) -> None:
    sb = _vm(daemon.client())
    try:
        # the whole guest stands still (as a hung kernel would), behind the daemon's back
        snapshots.command(daemon.state_dir / "vms" / sb.id / "qmp.sock", "stop")
        started = time.monotonic()
        with pytest.raises(dsec.SandboxGone, match="stopped answering"):
            sb.exec("true", timeout=2)
        assert time.monotonic() - started < 20  # the timeout, the kill's grace, no more
        info = sb.info()
        assert info.state == dsec.State.failed and "stopped answering" in (info.reason or "")
    finally:
        sb.kill()


def test_a_kernel_panic_is_reported(daemon: Daemon) -> None:
    sb = _vm(daemon.client())
    try:
        started = time.monotonic()
        with pytest.raises(dsec.SandboxGone, match="panicked"):
            sb.exec("echo c > /proc/sysrq-trigger; sleep 600", timeout=60)
        assert time.monotonic() - started < 30
        info = sb.info()
        assert info.state == dsec.State.failed and "Kernel panic" in (info.reason or "")
    finally:
        sb.kill()


def test_a_vm_outlives_a_killed_daemon() -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-vm-restart-"))
    d = start_daemon(state)
    try:
        sb = _vm(d.client())
        sb.exec("echo kept > /root/f")
        d.stop(signal.SIGKILL)
        d = start_daemon(state)
        sb = dsec.Sandbox.connect(sb.id, client=d.client())
        assert sb.info().state == dsec.State.running
        assert sb.exec("cat /root/f").stdout == "kept\n"  # the agent's channel is re-attached
        # the restarted daemon drains the console again: a flood neither stalls the guest nor grows the log
        res = sb.exec("head -c 3000000 /dev/zero | tr '\\0' x > /dev/console; echo done", timeout=120)
        assert res.stdout == "done\n"
        time.sleep(1)
        sizes = [p.stat().st_size for p in (state / "vms" / sb.id).glob("console.log*")]
        assert sizes and all(s <= 1 << 20 for s in sizes)
        # and still sees the VM's end
        snapshots.command(state / "vms" / sb.id / "qmp.sock", "quit")
        deadline = time.monotonic() + 10
        while sb.info().state == dsec.State.running and time.monotonic() < deadline:
            try:
                sb.exec("true", timeout=5)
            except dsec.SandboxGone:
                break
            time.sleep(0.2)
        info = sb.info()
        assert info.state == dsec.State.failed and "QEMU exited" in (info.reason or "")
    finally:
        shut_down(d)
        shutil.rmtree(state, ignore_errors=True)
