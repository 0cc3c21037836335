"""Daemon side of lazy layers: start or adopt the fetcher process, and mount layers from its files.

The fetcher (fetcher.py) is a separate, detached process so that restarting the daemon does not cut
running sandboxes off their layers: a new daemon adopts the fetcher it finds answering on its socket.
Each layer is then an EROFS file system mounted straight from the fetcher's FUSE file (EROFS
file-backed mount), or through a loop device on kernels without file-backed EROFS. Once the fetcher
has written a layer's complete local file, the layer's mount is replaced in place by one of that file
(``replace_mount``), so new sandboxes read it at local speed while running ones keep the old mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import BackendError, InvalidRequest
from ..isolation.loop import attach_loop
from ..isolation.mounts import MS_NODEV, MS_NOSUID, MS_RDONLY, is_mountpoint, mount, umount
from .cache import DEFAULT_FETCH_TIMEOUT

START_TIMEOUT = 15.0
REQUEST_TIMEOUT = 10.0
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class Fetcher:
    """A handle on the fetcher process serving ``root``; see fetcher.py for the layout under it."""

    def __init__(
        self,
        root: Path,
        repository_spec: str,
        cache_max: int,
        *,
        fetch_timeout: float = DEFAULT_FETCH_TIMEOUT,
        complete_dir: Path | None = None,
    ) -> None:
        self.root = root.resolve()
        self.complete_dir = (complete_dir or self.root / "complete").resolve()
        self.repository = str(repository_spec)
        self.cache_max = cache_max
        self.fetch_timeout = fetch_timeout
        self.mountpoint = self.root / "mnt"
        self.sock = self.root / "fetcher.sock"
        self.log = self.root / "fetcher.log"
        self.pid: int | None = None

    def path(self, digest: str) -> Path:
        """The layer's EROFS image as a file (its chunks are fetched as they are read)."""
        if not _DIGEST.match(digest):
            raise InvalidRequest(f"not a layer digest: {digest!r}")
        return self.mountpoint / digest

    async def request(self, request: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        """One control request; raises BackendError if the fetcher is unreachable or refuses."""
        try:
            reply = await asyncio.wait_for(self._exchange(request), timeout)
        except (OSError, TimeoutError, ValueError) as e:
            raise BackendError(f"the layer fetcher at {self.sock} did not answer: {e or type(e).__name__}") from e
        if not isinstance(reply, dict):
            raise BackendError(f"the layer fetcher sent a malformed reply: {reply!r}")
        if not reply.get("ok"):
            raise BackendError(f"the layer fetcher refused {request.get('op')}: {reply.get('error')}")
        return reply

    async def _exchange(self, request: dict[str, Any]) -> Any:
        reader, writer = await asyncio.open_unix_connection(str(self.sock), limit=1 << 24)
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
            if not line:
                raise ConnectionError("connection closed without a reply")
            return json.loads(line)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def ping(self) -> dict[str, Any] | None:
        """The fetcher's ping reply, or None if none is answering."""
        if not self.sock.exists():
            return None
        try:
            return await self.request({"op": "ping"}, timeout=2.0)
        except BackendError:
            return None

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Adopt the fetcher running on ``root``, or start one and wait until its mount is up."""
        if len(str(self.sock).encode()) > 107:
            raise InvalidRequest(f"fetcher root {self.root} is too long for a unix socket path under it")
        running = await self.ping()
        if running is not None:
            if running.get("repository") != self.repository:
                raise BackendError(
                    f"the layer fetcher on {self.root} (pid {running.get('pid')}) serves {running.get('repository')},"
                    f" not {self.repository}: stop it first"
                )
            self.pid = int(running["pid"])
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            if is_mountpoint(self.mountpoint):
                umount(self.mountpoint, lazy=True)  # a killed fetcher's mount: every access fails ENOTCONN
        self.pid = self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._exited():
                winner = await self.ping()
                if winner is not None:  # another start on this root raced us and won: use that one
                    self.pid = int(winner["pid"])
                    return
                raise BackendError(f"the layer fetcher exited while starting; {self._log_tail()}")
            reply = await self.ping()
            if reply is not None and is_mountpoint(self.mountpoint):
                return
            await asyncio.sleep(0.05)
        await self._kill()
        raise BackendError(f"the layer fetcher did not come up within {timeout:g}s; {self._log_tail()}")

    def _spawn(self) -> int:
        argv = [sys.executable, "-m", "dsec.images.fetcher", "--root", str(self.root)]
        argv += ["--repository", self.repository, "--cache-max", str(self.cache_max)]
        argv += ["--fetch-timeout", str(self.fetch_timeout), "--complete-dir", str(self.complete_dir)]
        log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            return os.posix_spawn(
                sys.executable,
                argv,
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                ],
                setsid=True,  # its own session: a signal to the daemon's process group does not reach it
            )
        finally:
            os.close(log_fd)

    def alive(self) -> bool:
        """Whether the fetcher this handle started or adopted still runs (cheap: no round trip)."""
        return not self._exited()

    def _exited(self) -> bool:
        if self.pid is None:
            return True
        try:
            # reaps it if this process spawned it (possibly through another Fetcher handle)
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return not _alive(self.pid)
        return bool(done)

    def _log_tail(self, size: int = 3000) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - size))
                return f"its log ({self.log}) ends with:\n" + f.read().decode(errors="replace")
        except OSError as e:
            return f"its log {self.log} is unreadable: {e}"

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Per layer seen by the fetcher (digest → size, read_bytes, fetched_bytes, chunks_fetched,
        chunk_hits, chunk_misses, fetch_wait_seconds, errors, prefetched, prefetch_errors)."""
        reply = await self.request({"op": "stats"})
        layers: dict[str, dict[str, Any]] = reply["layers"]
        return layers

    async def cache_stats(self) -> dict[str, Any]:
        """Node totals: the chunk cache's hits, misses, fetches, fetched/written bytes, evictions, size and
        cap, plus ``reads_in_flight`` (READs being served now)."""
        reply = await self.request({"op": "stats"})
        return {**reply["cache"], "reads_in_flight": reply["reads_in_flight"]}

    async def save_trace(self, digest: str) -> bool:
        """Store the layer's chunk access order in the repository unless one is there; True if written."""
        reply = await self.request({"op": "save_trace", "layer": digest})
        return bool(reply["written"])

    async def forget(self, digest: str) -> bool:
        reply = await self.request({"op": "forget", "layer": digest})
        return bool(reply["forgotten"])

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the fetcher (its layer mounts then fail their reads: unmount them first)."""
        if self.pid is None:
            running = await self.ping()
            if running is None:
                return
            self.pid = int(running["pid"])
        await self._kill(signal.SIGTERM, timeout)

    async def _kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            gone = await _wait_gone(pid, timeout)
            if not gone and sig != signal.SIGKILL:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                gone = await _wait_gone(pid, 10.0)
            if not gone:  # stuck in the kernel (D state): nothing more we can do
                raise BackendError(f"the layer fetcher (pid {pid}) does not die")
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (it has exited: reaps it if it was ours)
        self.pid = None
        with contextlib.suppress(OSError):
            if is_mountpoint(self.mountpoint):
                umount(self.mountpoint, lazy=True)


async def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait until a process has exited (a pidfd turns readable then, for children and others alike)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(pidfd, gone.set)
    try:
        await asyncio.wait_for(gone.wait(), timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _alive(pid: int) -> bool:
    """Whether a process that is not our child runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


# -- EROFS mounts of layer files


def mount_layer(source: Path, target: Path, *, method: str = "auto") -> str:
    """Mount the EROFS image ``source`` read-only at ``target``; returns how: "file" or "loop".

    "auto" mounts the file directly (EROFS file-backed mount, Linux 6.12+) and falls back to a loop
    device only where the kernel cannot. Blocking: the mount reads the superblock through the fetcher.
    """
    if method not in ("auto", "file", "loop"):
        raise InvalidRequest(f"unknown layer mount method {method!r}")
    flags = MS_RDONLY | MS_NODEV | MS_NOSUID
    if method != "loop":
        try:
            mount(str(source), target, "erofs", flags)
            return "file"
        except OSError as e:
            # ENOTBLK: this kernel's EROFS only mounts block devices
            if method == "file" or e.errno != errno.ENOTBLK:
                raise BackendError(f"cannot mount layer {source} at {target}: {e.strerror}") from e
    loop_fd, device = attach_loop(source)
    try:
        mount(device, target, "erofs", flags)
    except OSError as e:
        raise BackendError(f"cannot mount layer {source} (as {device}) at {target}: {e.strerror}") from e
    finally:
        os.close(loop_fd)  # after a mount it holds the device; after a failure this detaches it (autoclear)
    return "loop"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# the same numbers on every architecture (the unified syscall table)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429
_AT_FDCWD = -100
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOVE_MOUNT_BENEATH = 0x200  # Linux 6.5+


def replace_mount(source: Path, target: Path, staging: Path) -> None:
    """Replace the mount at ``target`` by an EROFS mount of ``source`` with no moment where the path
    shows anything else: the new mount is made at ``staging`` and cloned off it as a detached mount
    (a mount under a shared parent, as / is under systemd, cannot be moved itself), the clone is moved
    beneath the old mount (MOVE_MOUNT_BENEATH), and the old one detached from above it. Whoever holds
    the old mount (a sandbox's overlay holds a clone of it) keeps reading it. Raises BackendError,
    leaving ``target`` as it was, where the kernel cannot (before 6.5)."""
    staging.mkdir(exist_ok=True)
    tree = -1
    try:
        mount_layer(source, staging)
        tree = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, bytes(staging), _OPEN_TREE_CLONE | os.O_CLOEXEC)
        if tree < 0:
            raise BackendError(f"cannot clone the mount of {source}: {os.strerror(ctypes.get_errno())}")
        flags = _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_BENEATH
        if _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, bytes(target), flags) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"cannot move a mount of {source} beneath {target}: {os.strerror(err)}")
        umount(target, lazy=True)  # the top one: the old mount
    finally:
        if tree >= 0:
            os.close(tree)  # after a move it is attached and stays; after a failure this drops it
        with contextlib.suppress(OSError):
            umount(staging, lazy=True)
        with contextlib.suppress(OSError):
            staging.rmdir()


def unmount_layer(target: Path, *, lazy: bool = False) -> None:
    """Unmount a layer (a loop device under it detaches by itself); not mounted is not an error."""
    try:
        umount(target, lazy=lazy)
    except OSError as e:
        raise BackendError(f"cannot unmount layer at {target}: {e.strerror}") from e
