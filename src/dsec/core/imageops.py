"""The core's image actions on sandboxes: pack a sandbox's changes into a new image version
(pack_diff), grade a candidate in a sibling, and image removal and gc, which must know every image a
live sandbox or a backend still uses."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..errors import InvalidState
from ..images.canary import call_canaries
from ..protocol.grade import GradeRequest, GradeResult
from ..protocol.sandbox import GcResult, ImageInfo, SnapshotRequest
from ..tenancy import OPERATOR, Caller

if TYPE_CHECKING:
    from ..images.store import ImageStore
    from ..kinds.base import Backend
    from ..store.records import SandboxRecord
    from .grading import Grader

log = logging.getLogger("dsec.core")


class ImageActions:
    """Mixed into the SandboxManager, which provides what is declared here."""

    if TYPE_CHECKING:
        images: ImageStore
        grader: Grader
        backends: dict[str, Backend]
        _live: dict[str, SandboxRecord]
        _packing: dict[str, asyncio.Event]

        def _running(self, sandbox_id: str, caller: Caller = OPERATOR) -> tuple[SandboxRecord, Backend]: ...

        def _lock(self, sandbox_id: str) -> asyncio.Lock: ...

    def images_in_use(self) -> set[str]:
        used = {r.image_digest for r in self._live.values() if r.image_digest}
        for backend in self.backends.values():
            used |= backend.images_in_use()
        return used

    async def snapshot(self, sandbox_id: str, req: SnapshotRequest, *, caller: Caller = OPERATOR) -> ImageInfo:
        """pack_diff: freeze the sandbox, pack its writable layer, thaw it, publish a new image version.

        Only the freeze-and-pack part holds the sandbox still; uploading happens after it runs again.
        Allowed in: running.
        """
        rec, backend = self._running(sandbox_id, caller)
        name = await self.images.check_free(req.name, caller)
        rules = self.images.scrub.plus(req.scrub, defaults=req.scrub_defaults)
        parent = await self.images.resolve(rec.image)
        if rec.image_digest and parent.digest != rec.image_digest:
            raise InvalidState(f"image {rec.image} now names another version than sandbox {rec.id} runs on")
        async with self._lock(rec.id):
            rec, backend = self._running(sandbox_id)
            done = self._packing[rec.id] = asyncio.Event()
            try:
                async with backend.frozen_upper(rec) as upper:
                    staged = await self.images.pack(upper, rules)
            finally:
                done.set()
                self._packing.pop(rec.id, None)
        log.info("sandbox %s packed in %.1f ms (%d entries)", rec.id, staged.seconds * 1000, staged.scan.entries)
        with call_canaries(req.canaries):  # every layer of the new version is searched for them
            return await self.images.publish_diff(
                staged,
                name=name,
                parent=parent,
                source_sandbox=rec.id,
                description=req.description,
                owner=caller.owner,
            )

    async def grade(self, sandbox_id: str, req: GradeRequest, *, caller: Caller = OPERATOR) -> GradeResult:
        """Run ``req.cmd`` in a fresh sibling of the candidate's pristine image against a read-only copy
        of its ``req.paths`` (core/grading.py). Allowed in: running; the candidate is only read from."""
        return await self.grader.grade(sandbox_id, req, caller=caller)

    async def remove_image(self, name: str, *, caller: Caller = OPERATOR) -> None:
        await self.images.remove(name, self.images_in_use(), caller)

    async def gc_images(self) -> GcResult:
        return await self.images.gc(self.images_in_use())
