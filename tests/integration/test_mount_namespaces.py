"""A container sandbox's mounts live in a mount namespace of its own: the host's table does not grow with
the sandboxes held, and the daemon still reaches them (files, snapshots), also after a restart."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

import dsec

from .conftest import Daemon, scratch_dir, start_daemon
from .sandbox_mounts import sandbox_bundle


def host_mounts(under: str = "/") -> list[str]:
    """The host's mounts whose mount point is under ``under`` (other daemons on the machine mount too)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.split()[4].startswith(under)]


def test_held_sandboxes_add_nothing_to_the_host_mount_table(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    make_sandbox().exec("true")  # the image's layers are mounted once, on the host, before counting
    ours = str(daemon.state_dir)
    before = host_mounts(ours)
    held = [make_sandbox(cpu=0.05) for _ in range(6)]
    for sb in held:
        assert sb.exec("echo hi > /f && cat /f").stdout == "hi\n"
        sb.files.write("/api.txt", b"x")
    during = host_mounts(ours)
    assert len(during) == len(before), set(during) ^ set(before)
    assert not [line for line in during if any(sb.id in line for sb in held)]
    # inside, the sandbox's own root is an overlay on its size-limited tmpfs
    with sandbox_bundle(daemon, held[0]) as bundle:
        assert (bundle / "rootfs" / "f").read_text() == "hi\n"
        assert (bundle / "disk" / "upper" / "api.txt").read_bytes() == b"x"
    for sb in held:
        sb.kill()
    assert len(host_mounts(ours)) == len(before)


@pytest.mark.timeout(120)
def test_a_restarted_daemon_reaches_the_mounts_again() -> None:
    with scratch_dir("dsec-mntns-") as state:
        d = start_daemon(state)
        try:
            sb = dsec.Sandbox.create(image="dsec/busybox", client=d.client())
            sb.exec("echo kept > /kept.txt")
            d.stop(signal.SIGKILL)
            d = start_daemon(state)
            again = dsec.Sandbox.connect(sb.id, client=d.client())
            assert again.files.read("/kept.txt") == b"kept\n"
            image = again.snapshot(f"mntns-restart-{sb.id}")
            child = dsec.Sandbox.create(image=image.name, client=d.client())
            assert child.exec("cat /kept.txt").stdout == "kept\n"
            child.kill()
            again.kill()
            assert not [line for line in host_mounts() if sb.id in line]
        finally:
            d.stop()
