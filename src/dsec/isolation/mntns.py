"""Mount namespaces of their own for sandboxes' mounts, made on threads that go back to the host's.

Every new mount namespace starts as a copy of its parent's whole mount table, and an OCI runtime makes
one per container and reads the table besides. With a sandbox's mounts in the host's namespace (three
or more each), the 3,001st creation copied and read some 9,000 mounts and ran at a fifth of the first's
rate. Here each sandbox's mounts are made in a namespace unshared from the host's for it alone, so a
creation costs the same however many sandboxes are held, and the host's table never grows with them.

A thread can have a mount namespace of its own once it stops sharing its filesystem context with the
other threads (``unshare(CLONE_FS)``); the threads of ``MountNamespaces`` do that once, then for each
call enter a namespace (a new one, or a sandbox's), run the function, and return to the host's. A
process spawned meanwhile from that thread (``posix_spawn``) starts in that namespace.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("dsec.mntns")

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 0x80000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

T = TypeVar("T")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def is_mount_namespace(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("mnt:")
    except OSError:
        return False


def switch_namespace(ns: int) -> None:
    """Move the calling thread to the mount namespace ``ns``: only on a thread of ``MountNamespaces``,
    which has a filesystem context of its own and goes back to the host's namespace after each call."""
    _check(_libc.setns(ns, CLONE_NEWNS), "entering a mount namespace")


class MountNamespaces:
    """Runs functions inside mount namespaces other than the daemon's, on a few dedicated threads."""

    def __init__(self, threads: int = 4) -> None:
        self._host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self._cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsec-mntns", initializer=self._own_fs)

    _shared: MountNamespaces | None = None

    @classmethod
    def shared(cls) -> MountNamespaces:
        """The process's one pool (the container kind and the function kind's backend share it)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def _own_fs(self) -> None:
        try:
            _check(_libc.unshare(CLONE_FS), "unshare(CLONE_FS)")
        except OSError as e:
            self._local.broken = str(e)

    async def create(self, fn: Callable[..., T], *args: object) -> tuple[int, T]:
        """Run ``fn`` in a new mount namespace (a copy of the host's that passes nothing back to it);
        returns a descriptor of that namespace, which keeps it alive, and what ``fn`` returned. A
        failure leaves nothing behind: the namespace and its mounts go with the last reference."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._run, None, fn, args)

    async def enter(self, ns: int, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` inside the mount namespace ``ns``."""
        loop = asyncio.get_running_loop()
        _, result = await loop.run_in_executor(self._pool, self._run, ns, fn, args)
        return result

    def _run(self, target: int | None, fn: Callable[..., T], args: tuple[object, ...]) -> tuple[int, T]:
        broken = getattr(self._local, "broken", None)
        if broken:
            raise OSError(f"no mount namespace of its own for this thread: {broken}")
        ns = -1
        try:
            if target is None:
                _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
                # a shared host mount would carry this namespace's mounts back to the host's
                _check(_libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "making / a slave")
                ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            else:
                _check(_libc.setns(target, CLONE_NEWNS), "entering the sandbox's mount namespace")
            return ns, fn(*args)
        except BaseException:
            if ns >= 0:
                os.close(ns)
            raise
        finally:
            self._go_home()

    def _go_home(self) -> None:
        if _libc.setns(self._host, CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            self._local.broken = f"cannot return to the host's mount namespace: {os.strerror(err)}"
            log.critical("a mount namespace thread is stuck outside the host's namespace: %s", os.strerror(err))
            return
        os.fchdir(self._cwd)  # setns put this thread at the namespace's root

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
