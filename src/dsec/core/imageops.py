"""The core's image actions on sandboxes: pack a sandbox's changes into a new image version
(pack_diff), and image removal and gc, which must know every image a
live sandbox or a backend still uses."""

from __future__ import annotations

import logging

from ..errors import Forbidden, InvalidRequest, InvalidState
from ..images.canary import call_canaries
from ..images.push import push_version
from ..images.registry import parse_reference
from ..images.store import ImageStore, normalize
from ..protocol.pull import PushRequest, PushResult
from ..protocol.sandbox import GcResult, ImageInfo, SnapshotRequest
from ..tenancy import OPERATOR, Caller
from .sandboxes import Sandboxes

log = logging.getLogger("dsec.core")


class ImageActions:
    def __init__(self, sandboxes: Sandboxes, images: ImageStore) -> None:
        self.sandboxes = sandboxes
        self.images = images

    def images_in_use(self, *, pooled: bool = True) -> set[str]:
        """Versions live sandboxes run on; without ``pooled``, idle warm-pool ones left out (a name they
        alone use may be removed: its pools drain, core/warm.py)."""
        used = {r.image_digest for r in self.sandboxes.live() if r.image_digest and (pooled or r.pool is None)}
        for backend in self.sandboxes.backends.values():
            used |= backend.images_in_use()
        return used

    async def snapshot(self, sandbox_id: str, req: SnapshotRequest, *, caller: Caller = OPERATOR) -> ImageInfo:
        """pack_diff: freeze the sandbox, pack its writable layer, thaw it, publish a new image version.

        Only the freeze-and-pack part holds the sandbox still; uploading happens after it runs again.
        Allowed in: running.
        """
        rec, _ = self.sandboxes.running(sandbox_id, caller)
        name = await self.images.check_free(req.name, caller)
        rules = self.images.scrub.plus(req.scrub, defaults=req.scrub_defaults)
        parent = await self.images.resolve(rec.image)
        if rec.image_digest and parent.digest != rec.image_digest:
            raise InvalidState(f"image {rec.image} now names another version than sandbox {rec.id} runs on")
        async with self.sandboxes.lock(rec.id):
            rec, backend = self.sandboxes.running(sandbox_id)
            async with self.sandboxes.packing(rec.id), backend.frozen_upper(rec) as upper:
                staged = await self.images.pack(upper, rules)
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

    async def push(self, req: PushRequest, *, caller: Caller = OPERATOR) -> PushResult:
        """Push an image the caller may see to a registry this node may reach (--registry-allow)."""
        ref = parse_reference(req.reference)
        if not self.images.registry.allows(ref.registry):
            raise Forbidden(f"this node does not push to {ref.registry} (dsec serve --registry-allow)")
        if ref.digest is not None:
            raise InvalidRequest(f"push to a tag, not a digest ({req.reference}): the registry names the digest")
        image = await self.images.resolve(normalize(req.name), caller=caller, build=False)
        version = await self.images.catalog.version(image.digest)
        return await push_version(version, ref, self.images.layers, self.images.puller.client())

    async def remove_image(self, name: str, *, caller: Caller = OPERATOR) -> None:
        await self.images.remove(name, self.images_in_use(pooled=False), caller)

    async def gc_images(self) -> GcResult:
        return await self.images.gc(self.images_in_use())
