"""The user namespaces the container kind idmaps a sandbox's layers through, one per host uid range."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from ...isolation.idmap import FIRST_BASE, RANGE, UidSlots, idmapped_bind, make_userns
from ...isolation.mounts import umount
from ..base import BackendContext

# Ranges whose user namespace is kept once a sandbox's mounts are made: the lowest, which a take hands
# out first and so reuses most. Beyond them each is closed: every descriptor the daemon holds is copied
# into, and closed in, every process it starts (at 3,000 held, 16% of the host's CPU in a burst).
USERNS_KEPT = 64


class UserNamespaces:
    ctx: BackendContext
    helper_dir: Path
    agent_error: str | None
    uid_slots: UidSlots
    _userns_fds: dict[int, int]

    async def _userns_for(self, base: int) -> int:
        """A user namespace with this range's mapping, only to idmap layers (see USERNS_KEPT)."""
        fd = self._userns_fds.get(base)
        if fd is None:
            fd = self._userns_fds[base] = await make_userns(self._userns_helper(), base)
        return fd

    def _userns_helper(self) -> list[str]:
        if self.agent_error is None or (self.helper_dir / "agent").exists():
            return [str(self.helper_dir / "agent"), "--userns"]
        return ["unshare", "--user", "--", str(self.helper_dir / "busybox"), "sh", "-c", "echo; exec cat >/dev/null"]

    async def _probe_userns(self) -> None:
        """Idmapped mounts need kernel and file system support: try one on the helper directory."""
        base = self.uid_slots.take()
        try:
            fd = await make_userns(self._userns_helper(), base)
            try:
                with tempfile.TemporaryDirectory(dir=self.ctx.state_dir) as tmp:
                    target = Path(tmp) / "probe"
                    target.mkdir()
                    await asyncio.to_thread(idmapped_bind, self.helper_dir, target, fd)
                    owner = (await asyncio.to_thread(os.stat, target / "busybox")).st_uid
                    umount(target, lazy=True)
                    if owner != base:
                        raise OSError(f"idmapped mount shows uid {owner}, expected {base}")
            finally:
                os.close(fd)
        finally:
            self.uid_slots.release(base)

    def _userns_done(self, base: int | None) -> None:
        """The sandbox's mounts are made: its range's user namespace is no longer needed."""
        if base is not None and base >= FIRST_BASE + USERNS_KEPT * RANGE:
            fd = self._userns_fds.pop(base, None)
            if fd is not None:
                os.close(fd)
