"""What checkpoints need of the container kind: its writable layer frozen for packing, and a rollback
that keeps the container and changes its root (reroot.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import DsecError
from ...images.store import ImageRef
from ...isolation.cgroups import CgroupLayout
from ...isolation.idmap import attach, idmapped_tree, make_userns
from ...isolation.mounts import umount
from ...protocol.checkpoints import CheckpointSupport
from ...store.records import SandboxRecord
from . import reroot
from .agent import AgentChannel
from .rootfs import SandboxRoots
from .state import ContainerState
from .userns import UserNamespaces

log = logging.getLogger("dsec.container")


class ContainerCheckpoints(UserNamespaces):
    sandbox_dir: Path
    roots: SandboxRoots
    processes_error: str
    _channels: dict[str, AgentChannel]
    _next_roots: dict[str, _Preparation]  # per sandbox: its next root being prepared (or ready)
    _old_roots: dict[str, asyncio.Task[None]]  # per sandbox: its last rollback's unmount of the old root
    reroots = True

    if TYPE_CHECKING:

        async def _runtime_call(self, rec: SandboxRecord, action: str) -> None: ...
        def cgroup_layout(self) -> CgroupLayout: ...
        def cgroup_path(self, rec: SandboxRecord) -> str: ...

    def checkpoint_support(self) -> CheckpointSupport:
        return CheckpointSupport(files=True, processes=False, why=f"files only: {self.processes_error}")

    def frozen_upper(self, rec: SandboxRecord) -> contextlib.AbstractAsyncContextManager[Path]:
        return self._frozen_upper(rec)

    @contextlib.asynccontextmanager
    async def _frozen_upper(self, rec: SandboxRecord) -> AsyncIterator[Path]:
        """The writable layer, frozen, at a path of the host's mount namespace: the packer (mkfs.erofs)
        resolves its source to a canonical path, which a view through /proc/PID/fd would not survive."""
        host = self.sandbox_dir / rec.id  # as seen inside the sandbox's namespace
        await self._runtime_call(rec, "pause")
        view = host / "pack-view"
        base = ContainerState(rec).uid_base
        try:
            # the upper holds files owned by the sandbox's host range; a layer must hold the ids the
            # sandbox sees, which is what an inverse-idmapped view of it shows
            userns_fd = await make_userns(self._userns_helper(), base, inverse=True) if base is not None else None
            try:
                tree = await self.roots.inside(rec.id, idmapped_tree, host / "disk" / "upper", userns_fd)
            finally:
                if userns_fd is not None:
                    os.close(userns_fd)
            try:
                view.mkdir(exist_ok=True)
                await asyncio.to_thread(attach, tree, view)
            finally:
                os.close(tree)
            yield view
        finally:
            if view.exists():
                await asyncio.to_thread(umount, view, lazy=True)
                with contextlib.suppress(OSError):
                    view.rmdir()
            try:
                await self._runtime_call(rec, "resume")
            except DsecError as e:
                log.error("cannot thaw sandbox %s: %s", rec.id, e)

    def _rerootable(self, rec: SandboxRecord) -> int | None:
        """The init a rollback in place keeps; None where this sandbox has none it can keep (a function
        worker, an init that is not the agent, mounts not in a namespace of the sandbox's own)."""
        state = ContainerState(rec)
        pid = self.roots.init_of(rec.id)
        return None if state.worker or state.init != "agent" else pid

    async def reroot(self, rec: SandboxRecord, image: ImageRef) -> bool:
        """A rollback in place (reroot.py): every process but the init ended, ``image``'s root put under
        it, mounted now or taken ready from ``prepare_reroot``. False where this sandbox cannot: the
        core then makes it again."""
        pid = self._rerootable(rec)
        if pid is None:
            return False
        bundle = self.sandbox_dir / rec.id
        ready = await self._ready_root(rec, image)
        base = ContainerState(rec).uid_base
        userns_fd = await self._userns_for(base) if base is not None and not ready else None
        try:
            prepare = (
                None
                if ready
                else functools.partial(
                    reroot.prepare_next, bundle, image.layers, rec.limits.disk, base, userns_fd, image.stack
                )
            )
            group = self.cgroup_layout().unified_dir(self.cgroup_path(rec))
            self._old_roots[rec.id] = await reroot.reroot(
                self.roots, rec.id, bundle, group, pid, len(image.layers), prepare
            )
        finally:
            if userns_fd is not None:
                self._userns_done(base)
        return True

    def prepare_reroot(self, rec: SandboxRecord, image: ImageRef) -> None:
        """Mount, in the background, the root a rollback to ``image`` stands on (``reroot.prepare_next``),
        after the old root's unmount and any preparation before it: a rollback that finds it ready
        skips mounting (about a millisecond); one to another checkpoint unmounts it and mounts its own.
        An RL loop rolls back to one start again and again: the next is prepared after each."""
        if self._rerootable(rec) is None:
            return
        unmount = self._old_roots.pop(rec.id, None)
        prep = _Preparation(self._next_roots.pop(rec.id, None))
        prep.task = asyncio.get_running_loop().create_task(self._prepare(rec, image, prep, unmount))
        self._next_roots[rec.id] = prep
        _preparing.add(prep.task)
        prep.task.add_done_callback(_preparing.discard)

    async def _prepare(
        self, rec: SandboxRecord, image: ImageRef, prep: _Preparation, unmount: asyncio.Task[None] | None
    ) -> Hashable:
        """``prepare_reroot``'s work; what the prepared root is made of (``_made_of``), or None."""
        await asyncio.sleep(reroot.SETTLE_S)
        # waited for, never cancelled with this: each touches the same directories
        waits = [t for t in (unmount, prep.previous.task if prep.previous else None) if t is not None]
        if waits:
            await asyncio.wait(waits)
        prep.previous = None  # done with: no chain of them is kept
        prep.mounting = True
        base = ContainerState(rec).uid_base
        try:
            userns_fd = await self._userns_for(base) if base is not None else None
        except (OSError, DsecError) as e:
            log.info("sandbox %s: its next root is not prepared: %s", rec.id, e)
            return None
        try:
            made_of = _made_of(rec, image)
            args = (self.sandbox_dir / rec.id, image.layers, rec.limits.disk, base, userns_fd, image.stack)
            await self.roots.inside(rec.id, reroot.prepare_next, *args, own=True)
            return made_of
        except (OSError, DsecError) as e:  # the sandbox ended meanwhile; or the rollback mounts it
            log.info("sandbox %s: its next root is not prepared: %s", rec.id, e)
            return None
        finally:
            if userns_fd is not None:
                self._userns_done(base)

    async def _ready_root(self, rec: SandboxRecord, image: ImageRef) -> bool:
        """Whether ``reroot/next`` holds ``image``'s root, prepared and unchanged since (after waiting
        for a preparation still under way)."""
        self._old_roots.pop(rec.id, None)  # a rollback's own mounts wait for no unmount
        prep = self._next_roots.pop(rec.id, None)
        if prep is None:
            return False
        if not prep.begun():  # mounting now costs less than waiting for it
            await prep.stop()
            return False
        if prep.task.cancelled():  # only stop() and forget_prepared() cancel, on ones no longer listed
            return False
        try:
            made_of = await prep.task
            return made_of is not None and made_of == _made_of(rec, image)
        except Exception as e:  # built again by the rollback, which unmounts what is there
            log.warning("sandbox %s: its prepared root is not used: %s", rec.id, e)
            return False

    def forget_prepared(self, sid: str) -> None:
        """The sandbox ends: nothing waits for its preparation any more, which is let finish (a thread may
        be mounting with its descriptors); its namespace, and the mounts in it, go with its init."""
        prep = self._next_roots.pop(sid, None)
        if prep is not None and not prep.begun():
            prep.task.cancel()
        self._old_roots.pop(sid, None)


@dataclasses.dataclass(eq=False)
class _Preparation:
    """A next root being prepared; ``previous``: the one asked for before it, which it waits for."""

    previous: _Preparation | None
    task: asyncio.Task[Hashable] = dataclasses.field(init=False)
    mounting: bool = False

    def begun(self) -> bool:
        return self.mounting or self.task.done()

    async def stop(self) -> None:
        """Cancel it and those before it that have not begun; wait for one that has: then nothing of
        them touches ``reroot/next`` any more."""
        prep: _Preparation | None = self
        while prep is not None:
            if prep.begun():
                await asyncio.wait([prep.task])
                return
            prep.task.cancel()
            prep = prep.previous


_preparing: set[asyncio.Task[Hashable]] = set()  # held here: the loop keeps only weak references to tasks


def _made_of(rec: SandboxRecord, image: ImageRef) -> Hashable:
    """What a root is built from: its layer files by identity (a checkpoint removed and another saved
    under its name is not the same, even where the new file gets the old one's inode number) and the
    size of its writable layer. Not the change time: linking a file into the base changes it."""
    files = tuple((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) for st in (os.stat(p) for p in image.stack))
    return (tuple(image.layers), files, rec.limits.disk)
