"""Checkpoints of a container sandbox and rollbacks in place, through the SDK against a real daemon."""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import pytest

import dsec

from .conftest import Daemon

CHANGES = r"""
set -e
mkdir -p /work/dir
echo one > /work/file
chmod 4755 /work/file
ln -s file /work/link
echo owned > /work/owned && chown 1234:4321 /work/owned && chmod 0640 /work/owned
rm /bin/vi
mv /etc/hostname /etc/hostname.renamed
"""

STATE = r"""
cd /work
stat -c '%n %a %u:%g' file owned dir
readlink link
cat file
[ -e /bin/vi ] && echo vi-present || echo vi-absent
ls /etc/hostname* | tr '\n' ' '; echo
ls /work | tr '\n' ' '; echo
"""


def state(sb: dsec.Sandbox) -> str:
    out = sb.exec(STATE)
    assert out.exit_code == 0, out
    return out.stdout


def test_rollback_puts_the_files_back_exactly(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    assert sb.exec(CHANGES).exit_code == 0
    at_checkpoint = state(sb)
    c1 = sb.checkpoint("prepared")
    assert (c1.id, c1.name, c1.sandbox_id, c1.files, c1.processes) == ("c1", "prepared", sb.id, True, False)
    assert c1.size > 0
    # an episode changes, adds and removes files, over what the checkpoint holds and under it
    episode = "echo two > /work/file; rm /work/owned; touch /work/new; mkdir -p /x/y; echo z > /x/y/z; rm -r /usr/sbin"
    assert sb.exec(episode).exit_code == 0
    assert state(sb) != at_checkpoint
    sb.rollback("prepared")
    assert state(sb) == at_checkpoint
    assert sb.exec("[ -e /x ] || [ -e /work/new ] || ls /usr/sbin >/dev/null && echo ok").stdout == "ok\n"
    info = sb.info()
    assert info.id == sb.id and info.state == "running"
    # again, from the rolled-back state: the same checkpoint, by its id this time
    sb.exec("echo three > /work/file")
    sb.rollback(c1)
    assert state(sb) == at_checkpoint


def test_checkpoints_stack_after_a_rollback(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    sb.exec("echo 1 > /gen; mkdir /opq; touch /opq/a /opq/b")
    c1 = sb.checkpoint()
    sb.exec("echo 2 > /gen; rm -r /opq; mkdir /opq; touch /opq/c")
    c2 = sb.checkpoint()
    sb.exec("echo 3 > /gen; touch /opq/d")
    sb.rollback(c1)
    assert sb.exec("cat /gen; ls /opq").stdout == "1\na\nb\n"
    # a checkpoint taken on the rolled-back sandbox holds only what changed since, on c1's layer
    sb.exec("echo 4 > /gen")
    c3 = sb.checkpoint()
    assert [c.id for c in sb.checkpoints()] == ["c1", "c2", "c3"]
    sb.rollback(c2)
    assert sb.exec("cat /gen; ls /opq").stdout == "2\nc\n"
    # removing c1 does not take the layer c3 stands on
    sb.remove_checkpoint(c1)
    sb.rollback(c3)
    assert sb.exec("cat /gen; ls /opq").stdout == "4\na\nb\n"
    assert [c.id for c in sb.checkpoints()] == ["c2", "c3"]
    # ids are never reused
    assert sb.checkpoint().id == "c4"


def test_a_rollback_ends_running_commands_and_keeps_the_sandbox(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(network="full")
    c1 = sb.checkpoint()
    errors: list[BaseException] = []

    def long_command() -> None:
        try:
            sb.exec("sleep 60", timeout=90)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=long_command)
    t.start()
    deadline = time.monotonic() + 10
    while "sleep 60" not in sb.exec("ps -o args").stdout:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    began = time.monotonic()
    sb.rollback(c1)
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], dsec.InvalidState), errors
    assert "rollback" in str(errors[0])
    assert "sleep 60" not in sb.exec("ps -o args").stdout
    assert time.monotonic() - began < 5
    assert sb.info().network == "full"
    assert sb.network_status().policy == "full"


def _bundle_mounts(daemon: Daemon, sid: str) -> list[str]:
    """The mounts of the sandbox's bundle, in the mount namespace its init holds them in (rootfs.NS_FD)."""
    pid = json.loads((daemon.state_dir / "run" / "crun" / sid / "status").read_text())["pid"]
    table = subprocess.run(
        ["nsenter", f"--mount=/proc/{pid}/fd/5", "cat", "/proc/self/mountinfo"],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return sorted(line.split()[4] for line in table.splitlines() if f"/{sid}/" in line.split()[4])


def test_a_rollback_in_place_keeps_the_container(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    """A container's rollback keeps its init, network identity and volumes, and takes its files,
    processes and shared memory back; nothing of the old roots stays mounted."""
    client = daemon.client()
    volume = f"ckpt-{secrets.token_hex(4)}"
    client.create_volume(volume, size="16Mi")
    try:
        _in_place(make_sandbox(network="full", volumes={"/data": volume}), daemon)
    finally:
        for info in client.list():
            if any(v.name == volume for v in info.volumes):
                dsec.Sandbox.connect(info.id, client=client).kill()
        client.remove_volume(volume)


def _in_place(sb: dsec.Sandbox, daemon: Daemon) -> None:
    init_started = "cut -d' ' -f22 /proc/1/stat"
    before = sb.exec(f"{init_started}; hostname -i; echo prepared > /state").stdout
    c1 = sb.checkpoint()
    seen = []
    for i in range(4):
        sb.exec(f"echo step{i} > /state; echo kept{i} > /data/kept; echo shm > /dev/shm/seg; mkdir /made{i}")
        sb.exec("sleep 300 >/dev/null 2>&1 &")
        sb.rollback(c1)
        after = sb.exec(f"{init_started}; hostname -i; ps -o args | grep -c '^sleep' ; ls /dev/shm; ls -d /made*")
        assert after.stdout.startswith(before + "0\n"), after  # the same init and address, no sleep left
        assert sb.exec("cat /state /data/kept").stdout == f"prepared\nkept{i}\n"  # a volume is not rolled back
        seen.append(_settled_mounts(daemon, sb.id))
    # each rollback leaves the same mounts: the image's layers, the checkpoint's, the writable layer, the
    # volume and the root, and the next rollback's root prepared beside them (nothing of the old roots
    # once the background has unmounted them)
    assert seen[1:] == seen[:-1], seen
    names = [m.split(f"/{sb.id}/", 1)[1] for m in seen[0]]
    assert sorted(set(names)) == names and {"rootfs", "disk", "stack-0", "volume-0", "reroot"} <= set(names), names
    assert {"reroot/next/rootfs", "reroot/next/disk", "reroot/next/stack-0"} <= set(names), names


def _settled_mounts(daemon: Daemon, sid: str) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        now = _bundle_mounts(daemon, sid)
        if not any("/reroot/old-" in m for m in now) and any(m.endswith("/reroot/next/rootfs") for m in now):
            return now
        # the old roots are unmounted in the background, and the next root prepared after them
        assert time.monotonic() < deadline, now
        time.sleep(0.05)


def test_checkpoint_errors(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    sb = make_sandbox(disk="4Mi")
    with pytest.raises(dsec.CheckpointNotFound):
        sb.rollback("c1")
    with pytest.raises(dsec.InvalidRequest):
        sb.checkpoint("no spaces")
    sb.checkpoint("a")
    with pytest.raises(dsec.InvalidRequest, match="already has a checkpoint named"):
        sb.checkpoint("a")
    # the checkpoints' bytes count against the sandbox's disk limit
    sb.exec("head -c 3000000 /dev/urandom > /blob")
    sb.checkpoint("b")
    with pytest.raises(dsec.LimitExceeded, match="disk limit"):
        sb.checkpoint("c")
    sb.remove_checkpoint("b")
    sb.checkpoint("c")
    # another tenant's sandbox is answered as one that does not exist
    token = daemon.client().create_tenant(f"ckpt-{secrets.token_hex(3)}").token
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=daemon.url.removeprefix("unix://")),
        base_url="http://dsec",
        headers={"Authorization": f"Bearer {token}"},
    )
    for method, path, body in (
        ("POST", "checkpoints", {}),
        ("GET", "checkpoints", None),
        ("DELETE", "checkpoints/a", None),
        ("POST", "rollback", {"checkpoint": "a"}),
    ):
        reply = http.request(method, f"/v1/sandboxes/{sb.id}/{path}", json=body)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "sandbox_not_found", reply.text
    assert [c.name for c in sb.checkpoints()] == ["a", "c"]
    sb.kill()
    with pytest.raises(dsec.SandboxGone):
        sb.checkpoint()


def test_function_sandboxes_checkpoint_roll_back_and_fork(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    fn = make_sandbox(kind="function", image="dsec/busybox", network="full")
    fn.exec("mkdir -p /work; echo prepared > /work/state; echo scratch > /tmp/scratch")
    c1 = fn.checkpoint()
    fn.exec("echo stepped > /work/state; touch /work/extra")
    fn.rollback(c1)
    assert fn.exec("cat /work/state; ls /work").stdout == "prepared\nstate\n"
    # /tmp is the worker's scratch space, outside the writable layer: not kept (GET /v1/node says so)
    assert fn.exec("ls /tmp").stdout == ""
    copies = fn.fork(2, checkpoint=c1)
    assert len(copies) == 2 and not copies.failed
    for i, c in enumerate(copies):
        assert c.info().kind == "function"
        assert c.exec(f"cat /work/state; echo copy-{i} > /work/state").stdout == "prepared\n"
    # each copy its own: writable layer, randomness, clock (the host's), network identity
    assert [c.exec("cat /work/state").stdout for c in copies] == ["copy-0\n", "copy-1\n"]
    assert fn.exec("cat /work/state").stdout == "prepared\n"
    assert len({c.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for c in [fn, *copies]}) == 3
    for c in copies:
        assert abs(int(c.exec("date +%s").stdout) - time.time()) < 5
    addresses = {c.network_status().address for c in [fn, *copies]}
    assert len(addresses) == 3 and None not in addresses, addresses
    for c in copies:
        c.kill()


def test_fork_a_container_from_now_and_from_a_checkpoint(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    parent = make_sandbox(labels={"role": "parent"}, network="full")
    parent.exec("mkdir /work; echo prepared > /work/state; head -c 64 /dev/urandom > /work/seed")
    prepared = parent.checkpoint("prepared")
    parent.exec("echo stepped > /work/state")
    began = time.monotonic()
    copies = parent.fork(3)
    assert time.monotonic() - began < 10
    assert len(copies) == 3 and copies.failed == []
    seed = parent.exec("cat /work/seed | od -An -tx1").stdout
    for c in copies:
        info = c.info()
        assert info.forked_from == parent.id and info.started_from == "fork"
        assert info.labels == {"role": "parent"} and info.network == "full"
        assert c.exec("cat /work/state").stdout == "stepped\n"
        assert c.exec("cat /work/seed | od -An -tx1").stdout == seed
    # no shared writable state: each copy writes its own, the parent sees none of it
    for i, c in enumerate(copies):
        c.exec(f"echo copy-{i} > /work/state; touch /work/only-{i}")
    for i, c in enumerate(copies):
        assert c.exec("cat /work/state; ls /work").stdout == f"copy-{i}\nonly-{i}\nseed\nstate\n"
    assert parent.exec("cat /work/state; ls /work").stdout == "stepped\nseed\nstate\n"
    # separate identities: own hostnames and addresses, fresh kernel random state
    addresses = {c.network_status().address for c in [parent, *copies]}
    assert len(addresses) == 4, addresses
    randoms = {c.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for c in copies}
    assert len(randoms) == 3
    # from the checkpoint, with labels of their own
    from_ckpt = parent.fork(2, checkpoint=prepared, labels={"role": "child"})
    assert [c.exec("cat /work/state").stdout for c in from_ckpt] == ["prepared\n", "prepared\n"]
    assert all(c.info().labels == {"role": "child"} for c in from_ckpt)
    # a copy's own checkpoints and rollbacks stand on what it was made from, after its parent is gone
    child = from_ckpt[0]
    child.exec("echo child > /work/state")
    mine = child.checkpoint()
    assert mine.id == "c1"
    parent.kill()
    child.exec("rm -r /work")
    child.rollback(mine)
    assert child.exec("cat /work/state").stdout == "child\n"
    for c in [*copies, *from_ckpt]:
        c.kill()


@pytest.mark.timeout(300)
def test_a_fork_takes_its_copies_from_a_warm_pool(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    """Copies of a container whose image version has a warm pool are its idle sandboxes, put on the
    copy's files in place; what the pool lacks is made, and each copy is its own all the same."""
    client = daemon.client()
    limits = {"memory": "96Mi"}  # a shape of this test's own: no other test's creation is served by the pool
    client.set_warm_pool("it-fork", "dsec/busybox", 3, limits=limits, network="full")
    try:
        parent = make_sandbox(memory="96Mi", network="full")
        parent.exec("mkdir /work; echo prepared > /work/state")
        c1 = parent.checkpoint()
        parent.exec("echo stepped > /work/state")
        deadline = time.monotonic() + 120
        while (pool := next(p for p in client.warm_pools() if p.name == "it-fork")).idle < 3:
            assert time.monotonic() < deadline, pool
            time.sleep(0.1)
        copies = parent.fork(4, checkpoint=c1)
        assert len(copies) == 4 and not copies.failed
        pool = next(p for p in client.warm_pools() if p.name == "it-fork")
        assert pool.claims == 3, pool  # the fourth was made
        assert sum("claim" in c.info().timings for c in copies) == 3
        for i, c in enumerate(copies):
            info = c.info()
            assert info.forked_from == parent.id and info.started_from == "fork" and info.limits.memory == 96 << 20
            assert c.exec(f"cat /work/state; echo copy-{i} > /work/state").stdout == "prepared\n"
        assert [c.exec("cat /work/state").stdout for c in copies] == [f"copy-{i}\n" for i in range(4)]
        assert parent.exec("cat /work/state").stdout == "stepped\n"
        assert len({c.network_status().address for c in [parent, *copies]}) == 5
        assert len({c.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for c in copies}) == 4
        for c in copies:
            c.kill()
    finally:
        client.remove_warm_pool("it-fork")


def test_fork_errors(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    with pytest.raises(dsec.InvalidRequest, match="files only"):
        sb.fork(1, processes=True)
    with pytest.raises(dsec.CheckpointNotFound):
        sb.fork(1, checkpoint="nope")
    with pytest.raises(dsec.InvalidRequest):
        sb.fork(0)
    copies = sb.fork(1, processes=False)
    assert len(copies) == 1
    copies[0].kill()


def test_a_rebuild_takes_the_same_checkpoints_and_rollbacks(daemon: Daemon) -> None:
    client = daemon.client()
    tid = f"it/ckpt-{secrets.token_hex(3)}"
    sb = dsec.Sandbox.create("dsec/busybox", trajectory=tid, client=client)
    sb.exec("echo prepared > /state")
    sb.checkpoint("start")
    sb.exec("echo episode-1 > /state; touch /episode-1")
    sb.rollback("start")
    sb.exec("echo episode-2 >> /state")
    second = sb.checkpoint()
    assert second.id == "c2"
    sb.exec("rm /state")
    sb.rollback(second)
    assert sb.exec("cat /state; ls /").stdout.startswith("prepared\nepisode-2\n")
    # lost from outside the trajectory; the trainer resumes, and the log answers every call
    dsec.Sandbox.connect(sb.id, client=client).kill()
    resumed = dsec.Sandbox.create("dsec/busybox", trajectory=tid, client=daemon.client())
    assert resumed.id != sb.id
    assert resumed.exec("echo prepared > /state").replayed
    assert resumed.checkpoint("start").id == "c1"
    resumed.exec("echo episode-1 > /state; touch /episode-1")
    resumed.rollback("start")
    resumed.exec("echo episode-2 >> /state")
    assert resumed.checkpoint().id == "c2"
    resumed.exec("rm /state")
    resumed.rollback("c2")
    assert resumed.trajectory.replayed == 8
    assert resumed.exec("cat /state; ls /").replayed
    # the rebuilt sandbox went through the same checkpoints and rollbacks: the same state, the same ids
    out = resumed.exec("cat /state; [ -e /episode-1 ] && echo leaked || echo clean")
    assert not out.replayed and out.stdout == "prepared\nepisode-2\nclean\n"
    assert [(c.id, c.name) for c in resumed.checkpoints()] == [("c1", "start"), ("c2", None)]
    notes = {c.seq: c.note for c in client.trajectory_calls(tid)}
    assert not any(notes.values()), notes  # every re-applied call answered as recorded
    resumed.kill()


def test_the_node_says_what_a_checkpoint_captures(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    status = daemon.client().node()
    container = status.checkpoints["container"]
    assert container.files and not container.processes and container.why
    # what the node reports is what CRIU itself answers here (make installs Debian's criu)
    check = subprocess.run(["criu", "check"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        said = [line for line in (check.stdout + check.stderr).splitlines() if line.startswith("Error")]
        assert said and said[0].split("): ", 1)[-1] in container.why, (said, container.why)
        assert "cannot checkpoint on this kernel" in container.why
    else:
        assert "passes its checks" in container.why
    assert status.checkpoints["function"].files and "/tmp" in (status.checkpoints["function"].why or "")
    for kind in ("microvm", "vm"):  # a VM's saved memory holds all of it
        if kind in status.kinds:
            assert status.checkpoints[kind] == dsec.CheckpointSupport(files=True, processes=True)
    sb = make_sandbox()
    for ask in (lambda: sb.checkpoint(processes=True), lambda: sb.fork(1, processes=True)):
        with pytest.raises(dsec.InvalidRequest, match="files only") as refused:
            ask()
        assert container.why in str(refused.value)
    assert sb.checkpoint(processes=False).processes is False
