"""Reaching a container sandbox's mounts from a test: they live in a mount namespace of the sandbox's own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import dsec
from dsec.isolation.mntns import MountNamespaces, is_mount_namespace
from dsec.kinds.container.rootfs import NS_FD

from .conftest import Daemon


def init_pid(daemon: Daemon, sb: dsec.Sandbox) -> int:
    root = daemon.state_dir / "run" / "crun"
    runtime = "crun" if root.exists() else "runc"
    if not root.exists():
        root = daemon.state_dir / "run" / "runc"
    out = subprocess.run([runtime, "--root", str(root), "state", sb.id], capture_output=True, text=True, timeout=10)
    return int(json.loads(out.stdout)["pid"])


@contextlib.contextmanager
def sandbox_bundle(daemon: Daemon, sb: dsec.Sandbox) -> Iterator[Path]:
    """The sandbox's bundle directory with its mounts (rootfs/, disk/upper, ...), as the daemon sees it:
    opened inside the namespace its init holds (rootfs.NS_FD)."""
    ns = os.open(f"/proc/{init_pid(daemon, sb)}/fd/{NS_FD}", os.O_RDONLY | os.O_CLOEXEC)
    spaces = MountNamespaces(threads=1)
    try:
        assert is_mount_namespace(ns), "the sandbox's init holds no mount namespace"
        bundle = str(daemon.state_dir / "sandboxes" / sb.id)
        fd = asyncio.run(spaces.enter(ns, os.open, bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        try:
            yield Path(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    finally:
        spaces.close()
        os.close(ns)
