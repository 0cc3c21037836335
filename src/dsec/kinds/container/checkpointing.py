"""What checkpoints need of the container kind: its writable layer frozen for packing, and a rollback
that keeps the container and changes its root (reroot.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator
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

    async def reroot(self, rec: SandboxRecord, image: ImageRef) -> bool:
        """A rollback in place (reroot.py): every process but the init ended, ``image``'s root put under
        it. False where this sandbox cannot (a function worker, an init that is not the agent): the core
        then makes it again."""
        state = ContainerState(rec)
        pid = self.roots.init_of(rec.id)
        if state.worker or state.init != "agent" or pid is None:
            return False
        bundle = self.sandbox_dir / rec.id
        base = state.uid_base
        userns_fd = await self._userns_for(base) if base is not None else None
        try:
            build = functools.partial(
                reroot.build_next, bundle, image.layers, rec.limits.disk, base, userns_fd, image.stack
            )
            group = self.cgroup_layout().unified_dir(self.cgroup_path(rec))
            await reroot.reroot(self.roots, rec.id, bundle, group, pid, len(image.layers), build)
        finally:
            self._userns_done(base)
        return True
