"""Named volumes on this node: made, listed, removed on behalf of a caller, and lent to sandboxes.

A volume is a sparse ext4 image under ``STATE_DIR/volumes/images`` (its size is its quota), mounted on
the host at ``STATE_DIR/volumes/mnt/NAME`` while at least one live sandbox uses it; a kind binds its
sandboxes' views from there. The rules kept here:

- many sandboxes may mount a volume read-only, and one at a time read-write (a second writer is
  refused with ``VolumeInUse``: two writers on one file system see each other's half-written files,
  and nothing in a sandbox can tell when another is done);
- a volume mounted by a live sandbox cannot be removed (``VolumeInUse``);
- the E2B layer's content API borrows a volume for one call (``lend``): a write is a writer for that
  long (refused while a sandbox mounts the volume read-write; a sandbox asking to mount it read-write
  meanwhile is refused), a read a reader; either keeps it mounted, and unremovable, until it is done;
- ownership is as for images: a tenant sees and acts on its own volumes, and may mount the operator's
  (which have no owner) read-only; the operator acts on all of them.

Who mounts what is not stored: the live sandboxes' records hold their mounts, and ``readopt`` rebuilds
the table from them after a restart. A sandbox that reaches a terminal state gives its volumes back
(``release``, called by the state machine), and a volume nobody uses any more is unmounted from the
host in the background.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from ..errors import BackendError, DsecError, Forbidden, InvalidRequest, VolumeInUse, VolumeNotFound
from ..isolation import fsimage
from ..isolation.mounts import is_mountpoint
from ..protocol.volumes import Mode, VolumeCreate, VolumeInfo, VolumeUser, mode_of
from ..store.records import SandboxRecord, VolumeMount
from ..store.volumes import Volume, VolumeStore
from ..tenancy import OPERATOR, Caller

log = logging.getLogger("dsec.core")
Wanted = Mapping[str, str | tuple[str, Mode]]  # a creation's volumes: path -> name or (name, mode)


class VolumeHost(Protocol):
    """What the node does on the host for volumes (the unit tests put a fake in its place)."""

    def unavailable(self) -> str | None: ...

    async def make(self, image: Path, size: int) -> None: ...

    def mount(self, image: Path, target: Path) -> None: ...

    def unmount(self, target: Path) -> None: ...

    def is_mounted(self, target: Path) -> bool: ...

    def used(self, image: Path) -> int: ...

    def free(self, directory: Path) -> int: ...


class Ext4Host:
    """Volumes as sparse ext4 images, loop-mounted (isolation/fsimage.py)."""

    def unavailable(self) -> str | None:
        return fsimage.mkfs_available()

    async def make(self, image: Path, size: int) -> None:
        await fsimage.make_ext4(image, size)

    def mount(self, image: Path, target: Path) -> None:
        fsimage.mount_ext4(image, target)

    def unmount(self, target: Path) -> None:
        fsimage.unmount(target)

    def is_mounted(self, target: Path) -> bool:
        return is_mountpoint(target)

    def used(self, image: Path) -> int:
        return fsimage.used_bytes(image)

    def free(self, directory: Path) -> int:
        return fsimage.free_bytes(directory)


class Volumes:
    def __init__(self, root: Path, store: VolumeStore, host: VolumeHost | None = None) -> None:
        self.root = root
        self.images = root / "images"
        self.mounts = root / "mnt"
        self.store = store
        self.host: VolumeHost = host or Ext4Host()
        self._users: dict[str, dict[str, Mode]] = {}  # volume -> {sandbox id: mode}
        self._held: dict[str, list[str]] = {}  # sandbox id -> the volumes it holds
        self._lent: dict[str, dict[Mode, int]] = {}  # volume -> content-API calls under way, by mode
        self._locks: dict[str, asyncio.Lock] = {}  # per volume: its host mount, its creation and removal
        self._tasks: set[asyncio.Task[None]] = set()

    def image(self, name: str) -> Path:
        return self.images / f"{name}.ext4"

    def mount_point(self, name: str) -> Path:
        return self.mounts / name

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # ---- the API's calls ---------------------------------------------------------------------------

    async def create(self, req: VolumeCreate, caller: Caller = OPERATOR) -> VolumeInfo:
        why = self.host.unavailable()
        if why is not None:
            raise InvalidRequest(f"this node cannot make volumes: {why}")
        # the host's users have no business in tenants' data: only root (and bundles' own views) reach it
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for d in (self.images, self.mounts):
            d.mkdir(exist_ok=True)
        free = self.host.free(self.images)
        if req.size > free:
            # sparse, so not reserved: but a volume larger than the whole free disk could never be filled
            raise InvalidRequest(f"a volume of {req.size} bytes is larger than this node's free disk ({free} bytes)")
        volume = self.store.add(req.name, caller.owner, req.size)  # VolumeExists if the name is taken
        async with self._lock(req.name):
            try:
                await self.host.make(self.image(req.name), req.size)
            except BaseException:
                self.store.delete(req.name)
                raise
        return self._info(volume)

    def list(self, caller: Caller = OPERATOR) -> builtins.list[VolumeInfo]:
        return [self._info(v) for v in self.store.all() if caller.sees(v.owner)]

    def info(self, name: str, caller: Caller = OPERATOR) -> VolumeInfo:
        return self._info(self._seen(name, caller))

    async def remove(self, name: str, caller: Caller = OPERATOR) -> None:
        volume = self._seen(name, caller)
        if not caller.owns(volume.owner):
            raise Forbidden(f"volume {name!r} is the operator's: tenants may only mount it read-only")
        async with self._lock(name):
            users = self._users.get(name)
            if users:
                raise VolumeInUse(
                    f"volume {name!r} is mounted by {len(users)} live sandbox(es): {', '.join(sorted(users))}; "
                    "kill them first",
                    detail={"sandboxes": sorted(users)},
                )
            if self._lent.get(name):
                raise VolumeInUse(f"volume {name!r} is being read or written through the E2B content API; try again")
            target = self.mount_point(name)
            if await asyncio.to_thread(self.host.is_mounted, target):
                await asyncio.to_thread(self.host.unmount, target)
            self.store.delete(name)
            with contextlib.suppress(FileNotFoundError):
                self.image(name).unlink()
            with contextlib.suppress(OSError):
                target.rmdir()
        self._locks.pop(name, None)

    def _seen(self, name: str, caller: Caller) -> Volume:
        volume = self.store.get(name)
        if volume is None or not caller.sees(volume.owner):
            raise VolumeNotFound(f"no volume {name!r}")
        return volume

    def _info(self, volume: Volume) -> VolumeInfo:
        users = self._users.get(volume.name, {})
        return VolumeInfo(
            name=volume.name,
            size=volume.size,
            used=self.host.used(self.image(volume.name)),
            created_at=datetime.fromtimestamp(volume.created_at, UTC),
            owner=volume.owner,
            users=[VolumeUser(sandbox=s, mode=m) for s, m in sorted(users.items())],
        )

    # ---- lent to sandboxes ---------------------------------------------------------------------------

    def check(self, wanted: Wanted, caller: Caller = OPERATOR) -> builtins.list[VolumeMount]:
        """The mounts a creation asks for, if it may have them now: each volume exists and is the
        caller's to mount so, and none it wants read-write is held read-write by another live sandbox."""
        mounts = []
        for path, ref in sorted(wanted.items()):
            name, mode = mode_of(ref)
            volume = self._seen(name, caller)
            if mode == "rw" and not caller.owns(volume.owner):
                raise Forbidden(
                    f"volume {name!r} is the operator's: mount it read-only ({{{path!r}: [{name!r}, 'ro']}})"
                )
            writer = next((s for s, m in self._users.get(name, {}).items() if m == "rw"), None)
            if mode == "rw" and writer is not None:
                raise VolumeInUse(
                    f"volume {name!r} is mounted read-write by sandbox {writer}: one writer at a time "
                    "(mount it read-only, or wait until that sandbox ends)",
                    detail={"volume": name, "sandbox": writer},
                )
            if mode == "rw" and self._lent.get(name, {}).get("rw"):
                raise VolumeInUse(
                    f"volume {name!r} is being written through the E2B content API: one writer at a time "
                    "(mount it read-only, or try again when that write is done)",
                    detail={"volume": name},
                )
            mounts.append(VolumeMount(path, name, mode == "ro", str(self.mount_point(name))))
        return mounts

    def claim(self, sandbox_id: str, wanted: Wanted, caller: Caller = OPERATOR) -> builtins.list[VolumeMount]:
        """Take the volumes a creation asks for, all or none (``check``), for the sandbox; given back by
        ``release``. Their host mounts are made by ``mount`` once the sandbox has a record."""
        mounts = self.check(wanted, caller)
        for m in mounts:
            self._hold(sandbox_id, m)
        return mounts

    def _hold(self, sandbox_id: str, m: VolumeMount) -> None:
        self._users.setdefault(m.name, {})[sandbox_id] = "ro" if m.read_only else "rw"
        self._held.setdefault(sandbox_id, []).append(m.name)

    async def mount(self, mounts: builtins.list[VolumeMount]) -> None:
        """Make sure each volume is mounted on the host (the first user mounts it)."""
        for m in mounts:
            await self._ensure_mounted(m.name)

    async def _ensure_mounted(self, name: str) -> None:
        async with self._lock(name):
            if self.store.get(name) is None:  # removed before the sandbox's claim (a race it lost)
                raise VolumeNotFound(f"no volume {name!r}")
            target = self.mount_point(name)
            if await asyncio.to_thread(self.host.is_mounted, target):
                return
            try:
                await asyncio.to_thread(self.host.mount, self.image(name), target)
            except DsecError:
                raise
            except OSError as e:
                raise BackendError(f"cannot mount volume {name!r}: {e}") from e

    def release(self, sandbox_id: str) -> None:
        """The sandbox ended (or was never made): its volumes are free of it; one nobody uses any more
        is unmounted from the host in the background."""
        for name in self._held.pop(sandbox_id, []):
            users = self._users.get(name, {})
            users.pop(sandbox_id, None)
            if not users:
                self._users.pop(name, None)
                self._spawn(self._unmount_unused(name))

    def readopt(self, rec: SandboxRecord) -> None:
        """A recorded sandbox found after a restart holds the volumes its record says."""
        for m in rec.volumes:
            self._hold(rec.id, m)

    def in_use(self, name: str) -> dict[str, Mode]:
        return dict(self._users.get(name, {}))

    async def _unmount_unused(self, name: str) -> None:
        async with self._lock(name):
            target = self.mount_point(name)
            if (
                self._users.get(name)
                or self._lent.get(name)
                or not await asyncio.to_thread(self.host.is_mounted, target)
            ):
                return
            try:
                await asyncio.to_thread(self.host.unmount, target)
            except OSError as e:
                log.error("cannot unmount unused volume %s: %s", name, e)

    # ---- lent for one call of the content API -----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lend(self, name: str, caller: Caller, mode: Mode) -> AsyncIterator[Path]:
        """The volume's host mount for one call that reads (``ro``) or writes (``rw``) its files with no
        sandbox: mounted now if nobody uses it, and unmounted after if nobody does then. A write needs the
        volume to be the caller's and no sandbox to mount it read-write (the one-writer rule); content
        calls do not exclude each other (each write replaces whole files by a rename)."""
        volume = self._seen(name, caller)
        if mode == "rw":
            if not caller.owns(volume.owner):
                raise Forbidden(f"volume {name!r} is the operator's: tenants may only read it")
            writer = next((s for s, m in self._users.get(name, {}).items() if m == "rw"), None)
            if writer is not None:
                raise VolumeInUse(
                    f"volume {name!r} is mounted read-write by sandbox {writer}: its files are written there "
                    "until it ends (read them, or write them from that sandbox)",
                    detail={"volume": name, "sandbox": writer},
                )
        lent = self._lent.setdefault(name, {})
        lent[mode] = lent.get(mode, 0) + 1
        try:
            await self._ensure_mounted(name)
            if self.store.get(name) != volume:  # removed and made again meanwhile: another volume
                raise VolumeNotFound(f"no volume {name!r}")
            yield self.mount_point(name)
        finally:
            lent[mode] -= 1
            if not lent[mode]:
                del lent[mode]
            if not lent:
                self._lent.pop(name, None)
                if not self._users.get(name):
                    self._spawn(self._unmount_unused(name))

    # ---- the daemon's start and stop -----------------------------------------------------------------

    async def start(self) -> builtins.list[str]:
        """After re-adoption: mount what live sandboxes use, unmount what nobody does, and finish what a
        daemon that died in a creation or a removal left: a record without its image, an image without
        its record."""
        notes = []
        names = {v.name for v in self.store.all()}
        if self.images.is_dir():
            for leftover in self.images.glob("*.new"):
                leftover.unlink(missing_ok=True)
            for image in self.images.glob("*.ext4"):
                if image.stem not in names:  # its removal was cut short after the record went
                    image.unlink(missing_ok=True)
        for name in sorted(names):
            if not self.image(name).exists() and not self._users.get(name):
                self.store.delete(name)
                names.discard(name)
                notes.append(f"volume {name} had no image (its creation was cut short): removed")
        for name in sorted(names):
            target = self.mount_point(name)
            mounted = await asyncio.to_thread(self.host.is_mounted, target)
            if self._users.get(name) and not mounted:
                try:
                    await self._ensure_mounted(name)
                except DsecError as e:
                    notes.append(f"volume {name} is used by re-adopted sandboxes but cannot be mounted: {e}")
            elif not self._users.get(name) and mounted:
                await self._unmount_unused(name)
        if self.mounts.is_dir():
            for stray in self.mounts.iterdir():  # a removal the daemon died in
                if stray.name not in names and not await asyncio.to_thread(self.host.is_mounted, stray):
                    with contextlib.suppress(OSError):
                        stray.rmdir()
        return notes

    async def close(self) -> None:
        """Wait for background unmounts (bounded); mounts of volumes in use stay for their sandboxes."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=30)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no loop (a synchronous test): nothing was mounted by this process either
            work.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
