"""The vm kind: a real q35 QEMU guest booting the image's own systemd (TCG here, so one shared VM)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon, require_kind, resolves, systemd_spec

# systemd learns devices from udev: without it, units bound to a device (the console's getty) wait 90 s

UNIT = """[Unit]
Description=dsec test service

[Service]
ExecStart=/bin/sh -c 'echo started > /run/hello; exec sleep infinity'
"""


@pytest.fixture(scope="module")
def vm(daemon: Daemon) -> Iterator[dsec.Sandbox]:
    client = daemon.client()
    if not resolves("deb.debian.org"):
        pytest.skip("no route to the Debian archive to build a systemd image")
    # a step of this run's own (the apt layer below it stays cached): no other test's VM of the same image
    # (test_e2b_pty's) has left a memory-snapshot template for it, so this VM boots, as the test asks
    token = secrets.token_hex(4)
    spec = systemd_spec().run(f"echo {token} > /etc/dsec-test-boot")
    image = client.build(spec, f"test/systemd-vm:{token}").image.name
    require_kind(client, "vm")
    started = time.monotonic()
    sb = dsec.Sandbox.create(image=image, kind="vm", client=client, memory="512Mi", timeout=1800)
    print(f"\n[dsec] vm with systemd: created in {time.monotonic() - started:.1f}s")
    yield sb
    sb.kill()


def test_pid_1_is_the_images_systemd(vm: dsec.Sandbox) -> None:
    info = vm.info()
    assert info.kind == "vm" and info.started_from == "boot"
    res = vm.exec("cat /proc/1/comm; readlink /proc/1/exe; systemctl is-system-running")
    comm, exe, state = res.stdout.split()
    assert (comm, exe) == ("systemd", "/usr/lib/systemd/systemd")
    assert state in ("running", "degraded")
    # the machine is q35: PCI virtio devices, not the microvm's mmio ones
    assert "virtio" in vm.exec("cat /sys/bus/pci/devices/*/uevent").stdout


def test_a_systemd_service_starts_and_stops(vm: dsec.Sandbox) -> None:
    vm.files.write("/etc/systemd/system/hello.service", UNIT)
    res = vm.exec("systemctl daemon-reload && systemctl start hello && systemctl is-active hello && cat /run/hello")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "active\nstarted\n"
    assert vm.exec("systemctl stop hello; systemctl is-active hello").stdout == "inactive\n"
    # transient units too: they run in systemd's tree, not in the exec's cgroup
    script = (
        "systemd-run --quiet --unit=dsec-once sh -c 'cat /proc/self/cgroup > /run/once' && "
        "for i in $(seq 200); do [ -s /run/once ] && break; sleep 0.1; done; cat /run/once"
    )
    assert vm.exec(script).stdout == "0::/system.slice/dsec-once.service\n"


def test_exec_files_and_timeouts_go_through_the_agent(vm: dsec.Sandbox) -> None:
    res = vm.exec("pwd; echo $GREETING; cat", cwd="/tmp", env={"GREETING": "hi"}, stdin="in")
    assert res.stdout == "/tmp\nhi\nin"
    # each exec has a cgroup of its own beside systemd's tree, so a timeout kills the whole of it
    assert vm.exec("cat /proc/self/cgroup").stdout.startswith("0::/dsec/exec-")
    started = time.monotonic()
    timed = vm.exec("setsid sleep 300 & sleep 301", timeout=2)
    assert timed.timed_out and time.monotonic() - started < 20
    assert "sleep 30" not in vm.exec("/.dsec/busybox ps -o args").stdout
    vm.files.write("/srv/data.bin", bytes(range(256)))
    assert vm.files.read("/srv/data.bin") == bytes(range(256))
    # the writable layer is reachable where the daemon's tools read it
    assert vm.exec("cat /.dsec/rw/upper/srv/data.bin | wc -c").stdout.strip() == "256"


def test_the_agent_survives_systemd_and_cannot_be_replaced(vm: dsec.Sandbox) -> None:
    agent = vm.exec("/.dsec/busybox pidof dsec-agent").stdout.split()
    assert len(agent) == 1 and agent[0] != "1"
    pid = agent[0]
    assert vm.exec(f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout.startswith("@dsec-agent")
    assert vm.exec(f"cat /proc/{pid}/oom_score_adj").stdout.strip() == "-1000"
    denied = vm.exec("echo x > /.dsec/agent")
    assert denied.exit_code != 0 and "Read-only" in denied.stderr
    # systemd re-executing itself (as on an upgrade) leaves the agent where it is
    assert vm.exec("systemctl daemon-reexec").exit_code == 0
    assert vm.exec("/.dsec/busybox pidof dsec-agent").stdout.split() == [pid]


def test_a_checkpoint_of_a_full_vm_rolls_back_its_services_and_files(vm: dsec.Sandbox) -> None:
    vm.files.write("/etc/systemd/system/kept.service", UNIT.replace("hello", "kept"))
    assert vm.exec("systemctl daemon-reload && systemctl start kept && systemctl is-active kept").exit_code == 0
    vm.files.write("/srv/state", "at the checkpoint\n")
    c1 = vm.checkpoint()
    assert c1.processes
    vm.exec("systemctl stop kept; rm /srv/state")
    vm.rollback(c1)
    assert vm.files.read_text("/srv/state") == "at the checkpoint\n"
    assert vm.exec("systemctl is-active kept").stdout == "active\n"  # systemd's own state came back
    vm.exec("systemctl stop kept")
    vm.remove_checkpoint(c1)


def test_an_image_without_an_init_is_refused_before_booting(daemon: Daemon) -> None:
    client = daemon.client()
    client.build_image("dsec/debian:12")  # a minbase: no init system
    started = time.monotonic()
    with pytest.raises(dsec.InvalidRequest, match="has none"):
        dsec.Sandbox.create(image="dsec/debian:12", kind="vm", client=client)
    assert time.monotonic() - started < 10  # refused from the image's layers: no VM was booted for it
