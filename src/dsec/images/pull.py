"""Registry images into the layer store: each registry layer converted to an EROFS layer once per repository.

A pull resolves the reference (``RegistryClient``: the linux/amd64 manifest and config, each verified),
then for every layer looks for a record ``registry/layers/<sha256>-<scrub rules>.json`` in the layer
repository: it names the EROFS layer that blob became, so a base layer shared by thousands of task images
is fetched and converted once for every node that shares the repository. A layer without a record is
streamed (pull_stream.py: download → decompress → the safe extractor), scrubbed and packed like an
imported layer, published, and then recorded. Layers go in parallel, a few at a time per node, and two
pulls that need the same layer at once share one conversion.

The version is published under the reference's canonical name (``docker.io/library/python:3.11``) with
the image's config and its source: the digest the reference resolved to. ``if-not-present`` uses a name
the store has without asking the registry; ``always`` asks for the reference's manifest and pulls only if
its digest is not the one recorded, moving the name to the new version (sandboxes keep the version they
started on). Nothing is published until every layer is in: a failure leaves no version, no tag and no
record of the layer that failed (layers that were finished stay, recorded, for the next try).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, get_args

from pydantic import ValidationError

from ..errors import BackendError, ImageExists, ImageNotFound, InvalidRequest
from ..protocol.build import LayerRole
from ..protocol.names import PullPolicy, normalize
from . import oci
from .catalog import Catalog
from .erofs import StagedLayer
from .layers import NodeLayers
from .model import ImageConfig, ImageSource, ImageVersion, LayerRef, RegistryLayer, registry_layer_key
from .pull_progress import LayerProgress, PullProgress, PullReporter
from .pull_stream import stream_layer
from .registry import (
    LINUX_AMD64,
    Descriptor,
    Reference,
    RegistryClient,
    RegistryOptions,
    ResolvedImage,
    parse_reference,
)
from .repository import ObjectNotFound
from .scratch import MemoryScratch
from .scrub import ScrubRules

__all__ = ["LayerStore", "PullPolicy", "Pulled", "Puller", "scrub_fingerprint"]

log = logging.getLogger("dsec.images")


class LayerStore(Protocol):
    """What a pull needs of the ImageStore (which owns the Puller): its catalog, its node's layers, its
    scrub rules, and packing and publishing a layer as every other kind of layer is."""

    catalog: Catalog
    layers: NodeLayers
    scrub: ScrubRules

    async def pack(
        self, src: Path, rules: ScrubRules | None, *, drop_devices: bool = False, into: Path | None = None
    ) -> StagedLayer: ...

    async def publish_layer(self, staged: StagedLayer, role: LayerRole, by: str, *, keep: bool = True) -> LayerRef: ...


POLICIES: tuple[str, ...] = get_args(PullPolicy)


def scrub_fingerprint(rules: ScrubRules) -> str:
    """Which scrub rules a layer was packed with, short: part of its record's key."""
    text = "\n".join(sorted(rules.patterns))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Conversion:
    """One layer being fetched and converted on this node; every pull that needs it awaits ``task``."""

    progress: LayerProgress
    listeners: list[PullReporter] = field(default_factory=list)
    task: asyncio.Future[RegistryLayer] | None = None

    def report(self, *, phase: bool = True) -> None:
        for listener in list(self.listeners):
            if phase:
                listener.phase()
            else:
                listener.bytes()


@dataclass(frozen=True)
class Pulled:
    """A name's version as a pull leaves it (or finds it)."""

    name: str
    digest: str
    version: ImageVersion
    owner: str | None = None  # the tenant of a name a tenant published (a pulled name has none)


def _check_pulled(name: str, version: ImageVersion) -> None:
    """Only a pulled version's name moves with its registry: a name a build, snapshot or import took stays."""
    if version.source is None:
        raise ImageExists(
            f"image {name} on this node was not pulled from a registry (a build, snapshot or import took the "
            "name): a pull does not replace it; `dsec image rm` it first"
        )


class Puller:
    def __init__(self, store: LayerStore, options: RegistryOptions) -> None:
        self.store = store
        self.options = options
        self.active: dict[str, PullProgress] = {}  # canonical name → the pull in progress
        self._client: RegistryClient | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._conversions: dict[str, _Conversion] = {}
        self._slots = asyncio.Semaphore(options.parallel_layers)
        self.scratch = MemoryScratch(store.layers.root)

    def client(self) -> RegistryClient:
        if self._client is None:
            self._client = self.options.client()  # reads the Docker config: at the first pull, not at start
        return self._client

    async def close(self) -> None:
        """The daemon stops: conversions still running are cancelled (each removes its temporary files and
        records nothing), then the registry client is closed."""
        running = [c.task for c in self._conversions.values() if c.task is not None and not c.task.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.scratch.close()

    # ---- a pull ------------------------------------------------------------------------------------

    async def pull(
        self,
        reference: str | Reference,
        *,
        owner: str | None = None,
        policy: PullPolicy = "if-not-present",
        progress: Callable[[PullProgress], None] | None = None,
    ) -> Pulled:
        """``reference`` pulled under its canonical name (by ``owner``, the tenant asking, if any)."""
        if policy not in POLICIES:
            raise InvalidRequest(f"pull policy {policy!r}: expected one of {', '.join(POLICIES)}")
        ref = reference if isinstance(reference, Reference) else parse_reference(reference)
        name = normalize(str(ref))
        if policy == "if-not-present" and (found := await self._present(name, owner)) is not None:
            return found  # not a single request to the registry
        # one pull of a name at a time on the node: the second finds the first's tag (a lock is kept per
        # name pulled, a few dozen bytes each)
        async with self._locks.setdefault(name, asyncio.Lock()):
            state = self.active[name] = PullProgress(reference=name)
            reporter = PullReporter(state, progress)
            try:
                return await self._pull(ref, name, policy, owner, reporter)
            except BaseException:
                state.phase = "failed"
                reporter.phase()
                raise
            finally:
                self.active.pop(name, None)

    async def _present(self, name: str, owner: str | None) -> Pulled | None:
        """What the name holds now. Another tenant's image under it (a snapshot named like a registry
        reference) is neither handed out nor replaced: the name is taken, as for any publish."""
        tag = await self.store.catalog.tag(name)
        if tag is None:
            return None
        if tag.owner is not None and owner is not None and tag.owner != owner:
            raise ImageExists(f"image {name} already exists on this node and was not pulled from a registry")
        return Pulled(name, tag.digest, await self.store.catalog.version(tag.digest), tag.owner)

    async def _pull(
        self, ref: Reference, name: str, policy: PullPolicy, owner: str | None, reporter: PullReporter
    ) -> Pulled:
        catalog = self.store.catalog
        reporter.phase()
        current = await self._present(name, owner)  # another pull of the name may have finished while this one waited
        if current is not None and policy == "if-not-present":
            return current
        if current is not None:
            _check_pulled(name, current.version)
        client = self.client()
        top = await client.fetch_manifest(ref)
        if current is not None and current.version.source is not None and current.version.source.digest == top.digest:
            log.info("pull %s: unchanged in the registry (%s)", name, top.digest)
            return current
        image = await client.resolve(ref, LINUX_AMD64, top=top)  # what dsec's sandboxes run
        config = oci.image_config(image.config_data, f"config {image.manifest.config.digest} of {ref}")
        async with catalog.publishing():  # gc must not sweep layers this version is about to reference
            records = await self._layers(image, reporter)
            reporter.progress.phase = "publishing"
            reporter.phase()
            version = self._version(name, ref, image, top.digest, config, records, owner)
            now = await self._present(name, owner)  # a pull on another node may have published it meanwhile
            if now is not None:
                _check_pulled(name, now.version)
            digest = await catalog.publish(version, move=True)
        reporter.progress.phase = "done"
        reporter.phase()
        log.info("pulled %s (%s): %d layers", name, top.digest, len(records))
        return Pulled(name, digest, version)

    def _version(
        self,
        name: str,
        ref: Reference,
        image: ResolvedImage,
        top_digest: str,
        config: ImageConfig,
        records: list[RegistryLayer],
        owner: str | None,
    ) -> ImageVersion:
        layers = [
            LayerRef(
                digest=r.layer,
                role=LayerRole.base if i == 0 else LayerRole.toolkit,
                size=r.layer_size,
                created_by=f"pull of {ref.name}: layer {i + 1}/{len(records)} {r.digest}",
            )
            for i, r in enumerate(records)
        ]
        by = f" for tenant {owner}" if owner else ""
        return ImageVersion(
            name=name,
            layers=layers,
            config=config,
            description=f"pulled from {ref.name}@{top_digest}{by}",
            scrubbed=[p for r in records for p in r.scrubbed],
            source=ImageSource(
                reference=str(ref), digest=top_digest, manifest=image.digest, platform=str(image.platform)
            ),
        )

    # ---- layers ------------------------------------------------------------------------------------

    async def _layers(self, image: ResolvedImage, reporter: PullReporter) -> list[RegistryLayer]:
        descs = image.manifest.layers
        for i, desc in enumerate(descs):
            media = desc.media_type
            if media and media not in oci.LAYER_TYPES:
                raise InvalidRequest(f"layer {i + 1} of {image.reference} is a {media!r}, not a filesystem layer")
        rootfs = image.config.rootfs
        diff_ids: list[str | None] = list(rootfs.diff_ids) if rootfs is not None else [None] * len(descs)
        fingerprint = scrub_fingerprint(self.store.scrub)
        keys = [registry_layer_key(d.digest, fingerprint) for d in descs]
        found = await asyncio.gather(*(self._record(k) for k in keys))
        state = reporter.progress
        state.layers = [
            LayerProgress(d.digest, d.size, "reused" if f else "queued") for d, f in zip(descs, found, strict=True)
        ]
        state.phase = "layers"
        reporter.phase()
        jobs = []
        for i, (desc, key, record) in enumerate(zip(descs, keys, found, strict=True)):
            if record is None:
                jobs.append(self._converted(i, image.reference, desc, diff_ids[i], key, reporter))
        # every conversion runs to its end even when one fails: each is whole or nothing, and the finished
        # ones are recorded for the next try
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]  # the others, if any, were of the same pull: the first tells the story
        records = list(found)
        converted = iter(r for r in results if not isinstance(r, BaseException))
        return [r if r is not None else next(converted) for r in records]

    async def _record(self, key: str) -> RegistryLayer | None:
        """The record under ``key`` if its layer is still in the repository (gc may have taken it since)."""
        catalog = self.store.catalog
        try:
            record = RegistryLayer.model_validate_json(await catalog.repo.get(key))
        except ObjectNotFound:
            return None
        except ValidationError as e:
            log.warning("ignoring the malformed registry layer record %s: %s", key, e)
            return None
        try:
            await catalog.layer(record.layer)
        except (ImageNotFound, BackendError):
            return None
        return record

    async def _converted(
        self, i: int, ref: Reference, desc: Descriptor, diff_id: str | None, key: str, reporter: PullReporter
    ) -> RegistryLayer:
        """Layer ``i`` of the pull, converted here or by the pull on this node that started it first."""
        conversion = self._conversions.get(key)
        # one that ended (and failed: a success left a record) is not this pull's to share
        if conversion is None or conversion.task is None or conversion.task.done():
            new = conversion = _Conversion(reporter.progress.layers[i])
            self._conversions[key] = conversion
            # outlives the pull that started it (another may wait for it; a cancelled pull must not leave
            # the next one to start over), like a built-in image's build
            conversion.task = asyncio.ensure_future(self._convert(ref, desc, diff_id, key, conversion))

            def forget(_: object) -> None:
                if self._conversions.get(key) is new:
                    del self._conversions[key]

            conversion.task.add_done_callback(forget)
        else:
            conversion.progress.shared = True
            reporter.progress.layers[i] = conversion.progress
        conversion.listeners.append(reporter)
        task = conversion.task
        assert task is not None
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and (me is None or not me.cancelling()):  # not this pull that was cancelled
                raise BackendError(f"pulling layer {desc.digest} stopped: the node's image store is closing") from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                conversion.listeners.remove(reporter)
            reporter.phase()

    async def _convert(
        self, ref: Reference, desc: Descriptor, diff_id: str | None, key: str, conversion: _Conversion
    ) -> RegistryLayer:
        progress = conversion.progress
        try:
            async with self._slots, self.store.catalog.publishing():
                record = await self._record(key)  # another node may have converted it while this one queued
                if record is None:
                    record = await self._fetch_and_convert(ref, desc, diff_id, key, conversion)
                    progress.phase = "done"
                else:
                    progress.phase = "reused"
                return record
        except BaseException:
            progress.phase = "failed"
            raise
        finally:
            conversion.report()

    async def _fetch_and_convert(
        self, ref: Reference, desc: Descriptor, diff_id: str | None, key: str, conversion: _Conversion
    ) -> RegistryLayer:
        store, progress = self.store, conversion.progress
        label = f"layer {desc.digest} of {ref.name}"
        work = store.layers.tmp / f"pull-{secrets.token_hex(6)}"

        def on_bytes(done: int, size: int) -> None:
            progress.fetched = done
            conversion.report(phase=False)

        try:
            work.mkdir(parents=True)
            progress.phase = "fetching"
            conversion.report()
            stats = await stream_layer(self.client(), ref, desc, diff_id, work / "tree", label=label, on_bytes=on_bytes)
            limit = self.options.max_sparse_bytes
            if stats.sparse_bytes > limit:  # mkfs.erofs reads holes as data: a few bytes could cost an hour
                raise InvalidRequest(
                    f"{label}: its sparse files claim {stats.sparse_bytes} bytes with their holes, over the limit of "
                    f"{limit} for a pulled layer"
                )
            progress.phase = "converting"
            conversion.report()
            # A lazy node reads a pulled layer through its fetcher, as every other node does: a second,
            # local copy of the whole layer would double what a pull writes to the node's disk for bytes a
            # task mostly never reads. Its packed file is then only read for upload: in memory if it fits.
            lazy = store.layers.fetcher is not None
            into = self.scratch.place(stats.bytes) if lazy else None
            staged = await store.pack(work / "tree", store.scrub, drop_devices=True, into=into)
            try:
                await asyncio.to_thread(shutil.rmtree, work / "tree", True)  # the node's disk: before the upload
                progress.phase = "publishing"
                conversion.report()
                other = await self._record(key)  # a node that finished first: take its layer, as every node will
                if other is not None:
                    return other
                by = f"pull of {ref.name}: {desc.digest}"
                layer = await store.publish_layer(staged, LayerRole.base, by, keep=not lazy)
            finally:
                staged.blob.unlink(missing_ok=True)  # published blobs were moved into the node's blobs already
            record = RegistryLayer(
                digest=desc.digest,
                diff_id=diff_id,
                size=desc.size,
                layer=layer.digest,
                layer_size=layer.size,
                scrub=scrub_fingerprint(store.scrub),
                scrubbed=staged.scan.scrubbed,
            )
            await store.catalog.repo.put(key, record.model_dump_json().encode())
            return record
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
