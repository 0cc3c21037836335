"""Escapes to the host, to the platform and to other sandboxes: files, /proc, the agent, setuid."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec

from ..integration.conftest import qemu_pid
from .conftest import CONTAINER_KINDS, VM_KINDS, Daemon, HostMarkers, heartbeat, nonce, raw, raws, upload_probe

PATTERN = "dsec-host-marke[r]-[0-9a-f]{24}"  # the brackets keep grep's own argv from matching itself


def test_proc_fd_and_root_paths_do_not_reach_host_files(
    attacker: dsec.Sandbox, neighbour: dsec.Sandbox, host_markers: HostMarkers
) -> None:
    routes = []
    for p in host_markers.paths:
        routes += [
            f"cat {p}",
            f"cat /proc/self/root{p}",
            f"cat /proc/1/root{p}",
            f"cat /proc/self/cwd/../../../../..{p}",
            f"for f in /proc/self/fd/* /proc/1/fd/* /proc/*/cwd /proc/*/root; do cat $f/../../../..{p}; done",
            f"cat /.dsec/../../..{p}",
        ]
    script = "; ".join(f"{r} 2>/dev/null" for r in routes)
    script += "; for f in /proc/[0-9]*/fd/* /proc/[0-9]*/cwd /proc/[0-9]*/root /proc/[0-9]*/exe; do readlink $f; done"
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=60)
    assert host_markers.nonce not in res.stdout + res.stderr
    # nothing the attacker can see through /proc names the daemon's state dir (where the first marker is)
    state_dir = str(host_markers.paths[0].parent)
    assert state_dir not in res.stdout.replace(script, ""), res.stdout


def test_recursive_grep_from_root_finds_nothing_of_the_host(
    attacker: dsec.Sandbox, neighbour: dsec.Sandbox, host_markers: HostMarkers
) -> None:
    # a sandbox-local copy of the same shape proves the search works where it ran to completion
    inside = "dsec-host-marker-" + nonce() + nonce()[:8]
    attacker.files.write("/tmp/inside-marker", inside + "\n")
    script = (
        f'for d in /* /.dsec; do timeout 3 grep -r -o -h -s -E "{PATTERN}" "$d"; echo "TREE $d $?"; done; '
        f'timeout 6 grep -r -o -h -s -E "{PATTERN}" /; echo "ROOT $?"'
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=120, output_limit=1 << 20)
    found = set(re.findall(r"dsec-host-marker-[0-9a-f]{24}", res.stdout))
    assert host_markers.nonce not in found
    assert found == {inside}, found
    assert "TREE /tmp 0" in res.stdout  # the control was found by a search that finished
    attacker.exec("rm -f /tmp/inside-marker")


def test_other_sandboxes_files_and_processes_are_out_of_reach(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    secret = "neighbour-secret-" + nonce()
    neighbour.files.write("/tmp/neighbour-secret", secret)
    assert neighbour.exec("cat /tmp/neighbour-secret").stdout == secret  # it is there to be found
    script = (
        "cat /proc/*/root/tmp/neighbour-secret; ls /proc/*/root/tmp; "
        "for p in /proc/[0-9]*; do cat $p/cmdline; echo; done; "
        "find / -xdev -name neighbour-secret 2>/dev/null; "
        "timeout 5 grep -r -l -s neighbour-secre[t] /tmp /root /var /home /.dsec"
    )
    try:
        with heartbeat(neighbour):
            res = attacker.exec(script, timeout=60)
        assert secret not in res.stdout + res.stderr
        lines = [line.strip() for line in res.stdout.splitlines()]
        assert not [x for x in lines if x == "neighbour-secret" or x.endswith("/neighbour-secret")], lines
    finally:
        neighbour.exec("rm -f /tmp/neighbour-secret")


def test_the_control_api_is_neither_visible_nor_reachable(
    sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    sock = sec_daemon.url.removeprefix("unix://")
    state = sec_daemon.state_dir
    script = (
        f"ls -la {state} {state}/token {sock}; cat {state}/token; "
        f"echo GET / | nc -U {sock}; echo GET / | nc local:{sock}; "
        "find / -xdev \\( -name 'dsec.sock' -o -name token -o -name 'dsec.db*' \\) 2>/dev/null; "
        "cat /proc/net/unix"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=30)
    out = res.stdout + res.stderr
    assert sec_daemon.token not in out
    assert sock not in res.stdout and str(state) not in res.stdout
    assert "dsec.sock" not in res.stdout


def test_the_agent_cannot_be_killed_traced_or_impersonated(
    kind: str, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    sb = fresh_attacker()
    if kind == "vm":
        _vm_agent_killed_ends_the_sandbox_cleanly(sb, neighbour)
        return
    upload_probe(sb)
    agent = sb.exec("/.dsec/busybox pidof dsec-agent || echo 1").stdout.split()[0]
    ptrace, attach_request, process_vm_readv, pidfd_open, pidfd_getfd = 101, 16, 310, 434, 438
    with heartbeat(neighbour):
        # a short timeout: if the agent dies, the daemon gives up on this exec soon after it
        sb.exec(f"kill -KILL {agent}; kill -TERM {agent}; kill -STOP {agent}; kill -9 -1", timeout=5)
        forged = sb.exec(
            f'for f in /proc/{agent}/fd/*; do echo \'{{"op":"exec","argv":["true"]}}\' > $f; done; '
            f"cat /proc/{agent}/environ /proc/{agent}/maps; head -c 16 /proc/{agent}/mem"
        )
        if kind in CONTAINER_KINDS:
            # In a VM guest root may ptrace its own agent (the guest kernel is the boundary): a stopped
            # agent only costs the attacker its own VM, which the daemon then kills. Not run there.
            attach, readv, (fd, _) = raws(
                sb,
                [
                    (ptrace, (attach_request, agent, 0, 0)),
                    (process_vm_readv, (agent, "b:64", 1, "b:64", 1, 0)),
                    (pidfd_open, (agent, 0)),
                ],
            )
    token = nonce()
    # the platform still answers, with the real output of what it was asked to run
    assert sb.exec(["/.dsec/busybox", "echo", token]).stdout == token + "\n"
    assert sb.exec("echo $((6 * 7))").stdout == "42\n"
    if kind in CONTAINER_KINDS:
        assert attach[0] == -1 and attach[1] in (1, 13), attach  # EPERM (seccomp) / EACCES
        assert readv[0] == -1, readv
        assert forged.stdout.strip() == "", forged
        if fd >= 0:  # pidfd_open may be allowed; taking the agent's descriptors may not
            assert raw(sb, pidfd_getfd, fd, 0, 0)[0] == -1
    # in a VM the guest kernel is the boundary: guest root may trace its own agent; the host-side
    # channel (virtio-serial) stays the daemon's, which the exec answers above show.


def _vm_agent_killed_ends_the_sandbox_cleanly(sb: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    """Kind vm: the agent is an ordinary process beside the image's own init, and guest root can SIGKILL
    any process of its kernel (`kill -9 -1`). The safe outcome is the VM's end, not the agent's survival:
    the platform stops trusting the guest, kills its QEMU and says why; nothing outside the VM is touched."""
    pid = qemu_pid(sb.id)
    with heartbeat(neighbour):
        try:
            sb.exec("kill -9 -1", timeout=5)
        except dsec.SandboxGone:
            pass
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                sb.exec("true", timeout=10)
            except (dsec.SandboxGone, dsec.SandboxTimeout):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the vm sandbox kept answering after its agent was killed")
    info = sb.info()
    assert info.state in (dsec.State.failed, dsec.State.lost), info
    assert info.reason, info
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "the VM's QEMU outlived its sandbox"
    assert neighbour.exec("true").exit_code == 0


def _hash(sb: dsec.Sandbox, path: str) -> str:
    return hashlib.sha256(sb.files.read(path)).hexdigest()


def test_overwriting_the_shell_and_busybox_leaves_platform_image_and_neighbour_intact(
    sec_daemon: Daemon, kind: str, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    pristine = {p: _hash(neighbour, p) for p in ("/bin/sh", "/bin/busybox")}
    sb = fresh_attacker()
    evil = "#!/tmp/x/busybox sh\necho pwned; exit 0\n"
    with heartbeat(neighbour):
        res = sb.exec(
            "mkdir -p /tmp/x && cp /bin/busybox /tmp/x/ && B=/tmp/x/busybox && $B rm -f /bin/sh /bin/busybox && "
            f"printf '{evil}' > /bin/sh && $B cp /bin/sh /bin/busybox && $B chmod 755 /bin/sh /bin/busybox"
        )
    assert res.exit_code == 0, res
    assert sb.files.read("/bin/busybox") == evil.encode()  # the attack landed in its own sandbox
    token = nonce()
    assert sb.exec(["/.dsec/busybox", "echo", token]).stdout == token + "\n"  # the platform's exec works
    assert {p: _hash(neighbour, p) for p in pristine} == pristine
    fresh = fresh_attacker()
    assert {p: _hash(fresh, p) for p in pristine} == pristine  # the image is unchanged
    assert fresh.exec("echo $((1 + 1))").stdout == "2\n"


# not "vm": dsec/debian:12 has no init to boot; the busybox case covers the vm kind
@pytest.mark.parametrize("kind", ["container", "function", "microvm"], indirect=True)
def test_overwriting_bash_and_python3_in_a_debian_image(
    sec_daemon: Daemon, kind: str, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    sb = fresh_attacker(image="dsec/debian:12")
    targets = ["/bin/bash", "/usr/bin/python3"]  # the builtin dsec/debian:12 ships both
    assert sb.exec("test -e /bin/bash && test -e /usr/bin/python3").exit_code == 0
    pristine = {p: _hash(sb, p) for p in targets}
    with heartbeat(neighbour):
        for p in targets:
            sb.exec(f"rm -f {p}; printf '#!/bin/dash\\necho pwned\\n' > {p}; chmod 755 {p}")
    assert all(sb.files.read(p).startswith(b"#!/bin/dash") for p in targets)
    token = nonce()
    assert sb.exec(["/bin/echo", token]).stdout == token + "\n"
    fresh = fresh_attacker(image="dsec/debian:12")
    assert {p: _hash(fresh, p) for p in targets} == pristine
    assert fresh.exec(["/bin/bash", "-c", "echo $((2 * 3))"]).stdout == "6\n"
    assert fresh.exec(["/usr/bin/python3", "-c", "print(6 * 7)"]).stdout == "42\n"


def test_setuid_root_binary_gains_nothing_for_an_unprivileged_user(
    kind: str, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    attacker.exec("cp /usr/local/bin/probe /tmp/suid && chown 0:0 /tmp/suid && chmod 4755 /tmp/suid")
    assert attacker.exec("stat -c %a /tmp/suid").stdout.strip() == "4755"
    with heartbeat(neighbour):
        res = attacker.exec(["/tmp/suid", "id"], user="65534")
    attacker.exec("rm -f /tmp/suid")
    assert res.exit_code == 0, res
    if kind in VM_KINDS:
        # the guest kernel is the boundary: setuid works inside the guest as on any Linux machine,
        # and guest root is not host root (the VMM jail's own uid; see test_vm_jail.py)
        assert res.stdout in ("uid=65534 euid=0\n", "uid=65534 euid=65534\n"), res
    else:
        assert res.stdout == "uid=65534 euid=65534\n", res  # no_new_privs: the bit is ignored


HOST_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def test_host_device_nodes_cannot_be_taken_over(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    """The device nodes a container sees are the host's own, bound in: chmod or chown of them from inside
    must fail, and from the host they stay root's, mode 666. (Found 2026-12-03: crun chowned the host's
    /dev/null, handed to it as stdin, to the sandbox's root, which could then chmod it host-wide.)"""
    devs = " ".join(HOST_DEVICES)
    script = (
        f"for d in {devs}; do chmod 600 $d 2>/dev/null && echo chmod-ok $d; "
        "chown 0:0 $d 2>/dev/null && echo chown-ok $d; done; echo x > /dev/null; cat /dev/null; echo done"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=30)
    assert res.stdout.endswith("done\n"), res
    for dev in HOST_DEVICES:
        st = Path(dev).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o666), f"host {dev}: {st}"
    # in a container none of them may change hands; a VM's guest root owns its guest's own nodes
    if attacker.kind in CONTAINER_KINDS:
        assert "-ok" not in res.stdout, res.stdout
