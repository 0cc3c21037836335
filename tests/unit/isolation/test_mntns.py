"""Mount namespaces made and entered on threads that return to the host's namespace."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from dsec.isolation.mntns import MountNamespaces, is_mount_namespace
from dsec.isolation.mounts import mount, umount
from dsec.proc import spawn, wait

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


def mounted_here(path: Path) -> bool:
    """In the calling thread's mount namespace (/proc/self is the main thread's)."""
    with open("/proc/thread-self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_a_mount_made_inside_stays_inside_and_is_reached_by_descriptor() -> None:
    spaces = MountNamespaces(threads=2)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "m"
        target.mkdir()

        def make() -> int:
            mount("tmpfs", target, "tmpfs", 0, "size=1m")
            (target / "inside.txt").write_text("hello")
            return os.open(tmp, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

        async def go() -> tuple[int, int, bool]:
            ns, fd = await spaces.create(make)
            seen = await spaces.enter(ns, mounted_here, target)
            return ns, fd, seen

        ns, fd, seen_inside = asyncio.run(go())
        try:
            assert is_mount_namespace(ns) and seen_inside
            assert not mounted_here(target), "the mount leaked into the host's namespace"
            assert not (target / "inside.txt").exists()
            assert (Path(f"/proc/self/fd/{fd}") / "m" / "inside.txt").read_text() == "hello"
            # the threads are back home: a path of the host resolves as the host sees it
            assert asyncio.run(spaces.enter(ns, lambda: True))
            assert not asyncio.run(asyncio.to_thread(mounted_here, target))

            async def child_sees() -> int:
                r, w = os.pipe2(os.O_CLOEXEC)
                argv = ["/bin/sh", "-c", f"cat {target}/inside.txt"]
                pid = await spaces.enter(ns, spawn, argv, {1: w})
                os.close(w)
                out = os.read(r, 100)
                os.close(r)
                await wait(pid)
                return len(out)

            assert asyncio.run(child_sees()) == 5  # a child spawned from inside starts inside
            asyncio.run(spaces.enter(ns, umount, target))
        finally:
            os.close(fd)
            os.close(ns)
            spaces.close()


def test_a_failure_inside_leaves_the_thread_at_home() -> None:
    spaces = MountNamespaces(threads=1)

    def fail() -> None:
        raise OSError("no")

    try:
        with pytest.raises(OSError, match="no"):
            asyncio.run(spaces.create(fail))
        home = os.readlink("/proc/self/ns/mnt")
        assert asyncio.run(spaces.enter(os.open("/proc/self/ns/mnt", os.O_RDONLY), lambda: home)) == home

        def where() -> str:
            return os.readlink("/proc/thread-self/ns/mnt")

        assert spaces._pool.submit(where).result(timeout=10) == home
    finally:
        spaces.close()
