"""Pause, resume and fork of real micro-VMs: copies carry the parent's processes and files, each with
its own memory, clock and random state. One parent VM and two copies (TCG here: VMs are few)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon, require_kind


@pytest.fixture(scope="module")
def parent(daemon: Daemon) -> Iterator[dsec.Sandbox]:
    require_kind(daemon.client(), "microvm")
    sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=daemon.client(), memory="192Mi")
    yield sb
    sb.kill()


def test_pause_stops_the_machine_and_resume_goes_on(parent: dsec.Sandbox) -> None:
    parent.exec("(while true; do date +%s >> /tmp/ticks; sleep 0.2; done) >/dev/null 2>&1 &")
    time.sleep(1)
    parent.pause()
    assert parent.info().state == dsec.State.paused
    with pytest.raises(dsec.InvalidState, match="paused"):
        parent.exec("true")
    time.sleep(2)
    parent.resume()
    after = parent.exec("wc -l < /tmp/ticks; date +%s").stdout.split()
    time.sleep(1)
    later = int(parent.exec("wc -l < /tmp/ticks").stdout)
    assert later > int(after[0])  # the background loop survived the pause and runs again
    assert abs(int(after[1]) - time.time()) < 5  # the clock was set after the pause


def test_fork_copies_a_running_machine(parent: dsec.Sandbox) -> None:
    parent.files.write("/work/state.txt", "before the fork\n")
    parent.exec("(while true; do echo tick >> /tmp/forked-ticks; sleep 0.2; done) >/dev/null 2>&1 &")
    started = time.monotonic()
    copies = parent.fork(2, labels={"role": "copy"})
    took = time.monotonic() - started
    try:
        assert len(copies) == 2 and took < 60
        assert parent.info().state == dsec.State.running  # the parent runs on
        for copy in copies:
            info = copy.info()
            assert info.forked_from == parent.id and info.started_from == "fork" and info.labels == {"role": "copy"}
            assert copy.files.read_text("/work/state.txt") == "before the fork\n"
            # the parent's background process lives on in each copy
            grown = copy.exec("a=$(wc -l < /tmp/forked-ticks); sleep 1; b=$(wc -l < /tmp/forked-ticks); echo $a $b")
            a, b = map(int, grown.stdout.split())
            assert b > a
        # each copy has its own writable layer, memory, clock and random state
        copies[0].files.write("/work/state.txt", "copy 0\n")
        assert copies[1].files.read_text("/work/state.txt") == "before the fork\n"
        assert parent.files.read_text("/work/state.txt") == "before the fork\n"
        outputs = [c.exec("head -c 16 /dev/urandom | od -An -tx1; date +%s").stdout.split("\n") for c in copies]
        assert outputs[0][0] != outputs[1][0]
        for out in outputs:
            assert abs(int(out[1]) - time.time()) < 10
    finally:
        for copy in copies:
            copy.kill()


def test_fork_of_a_paused_machine_and_of_a_container(parent: dsec.Sandbox, daemon: Daemon) -> None:
    parent.pause()
    try:
        (copy,) = parent.fork(1)
        try:
            assert parent.info().state == dsec.State.paused
            assert copy.exec("echo alive").stdout == "alive\n"
        finally:
            copy.kill()
    finally:
        parent.resume()
    with dsec.Sandbox.create(image="dsec/busybox", client=daemon.client()) as box:
        with pytest.raises(dsec.InvalidRequest, match="files only"):
            box.fork(1, processes=True)  # a container's copies carry its files (test_checkpoints.py)
        box.pause()  # containers pause through the cgroup freezer
        assert box.info().state == dsec.State.paused
        box.resume()
        assert box.exec("echo ok").stdout == "ok\n"


def test_a_full_vm_forks_and_pauses_too(daemon: Daemon) -> None:
    require_kind(daemon.client(), "vm")
    vm = dsec.Sandbox.create(image="dsec/busybox", kind="vm", client=daemon.client(), memory="256Mi")
    try:
        vm.exec("echo from-parent > /root/mark")
        vm.pause()
        vm.resume()
        (copy,) = vm.fork(1)
        try:
            assert copy.info().kind == "vm"
            # the image's init runs in the copy as in the parent
            assert copy.exec("cat /root/mark; cat /proc/1/comm").stdout == "from-parent\ninit\n"
        finally:
            copy.kill()
    finally:
        vm.kill()
    # each kind keeps its own templates: the vm kind's did not displace the microvm's of this module
    again = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=daemon.client(), memory="192Mi")
    try:
        assert again.info().started_from == "snapshot"
    finally:
        again.kill()


def test_checkpoint_rollback_and_fork_from_a_checkpoint(parent: dsec.Sandbox) -> None:
    """A VM's checkpoint is its saved memory: files and processes. A rollback restores it in place (same
    id, its clock and random state refreshed); copies can be made from it later."""
    parent.files.write("/work/ckpt.txt", "at the checkpoint\n")
    parent.exec("(while true; do echo x >> /tmp/kept-ticks; sleep 0.2; done) >/dev/null 2>&1 &")
    c1 = parent.checkpoint("vm-start")
    assert c1.processes and c1.files and c1.size > 0
    parent.files.write("/work/ckpt.txt", "after\n")
    parent.exec("touch /work/later; sh -c 'while true; do sleep 1; done' later-marker >/dev/null 2>&1 &")
    marked = "ps -o args | grep later-marker | grep -vc grep"
    assert parent.exec(marked).stdout == "1\n"
    before = parent.exec("head -c 16 /dev/urandom | od -An -tx1").stdout
    parent.rollback(c1)
    info = parent.info()
    assert info.id == parent.id and info.state == dsec.State.running
    assert parent.files.read_text("/work/ckpt.txt") == "at the checkpoint\n"
    assert parent.exec("[ -e /work/later ] && echo there || echo gone").stdout == "gone\n"
    assert parent.exec(marked).stdout == "0\n"  # started after the checkpoint: not there any more
    grown = parent.exec("a=$(wc -l < /tmp/kept-ticks); sleep 1; b=$(wc -l < /tmp/kept-ticks); echo $a $b")
    a, b = map(int, grown.stdout.split())
    assert b > a  # the loop running at the checkpoint runs again
    assert abs(int(parent.exec("date +%s").stdout) - time.time()) < 5
    assert parent.exec("head -c 16 /dev/urandom | od -An -tx1").stdout != before
    copies = parent.fork(1, checkpoint="vm-start")
    try:
        assert len(copies) == 1
        assert copies[0].files.read_text("/work/ckpt.txt") == "at the checkpoint\n"
    finally:
        for c in copies:
            c.kill()
    parent.remove_checkpoint(c1)
    assert parent.checkpoints() == []
