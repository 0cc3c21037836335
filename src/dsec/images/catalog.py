"""Image versions, tags and layers in the layer repository: publish, resolve, history, untag, gc.

Everything here lives in the repository, so every node that shares it sees the same images. A tag is
written once: a published name never changes meaning (a trainer that evaluated on ``env:v3`` can
rely on ``env:v3`` being the same bytes tomorrow); ``untag`` frees the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import BackendError, ImageExists, ImageInUse, ImageNotFound
from .chunks import ChunkStore, PutStats
from .model import (
    REGISTRY_LAYERS,
    CachedStep,
    ImageVersion,
    LayerManifest,
    RegistryLayer,
    Tag,
    image_key,
    layer_key,
    tag_key,
    trace_key,
)
from .repository import LayerRepository, ObjectNotFound

log = logging.getLogger("dsec.images")
M = TypeVar("M", bound=BaseModel)


@dataclass
class GcReport:
    images_deleted: int = 0
    layers_deleted: int = 0
    chunks_deleted: int = 0
    kept_layers: int = 0
    kept_chunks: int = 0
    bytes_freed: int = 0
    in_use: list[str] = field(default_factory=list)


class Catalog:
    def __init__(self, repo: LayerRepository) -> None:
        self.repo = repo
        self.chunks = ChunkStore(repo)
        self._versions: dict[str, ImageVersion] = {}  # immutable, so cached forever
        self._layers: dict[str, LayerManifest] = {}
        # gc must not sweep chunks a publish has uploaded but not yet referenced from a manifest
        self._gc_lock = asyncio.Lock()
        self._publishing = 0
        self._no_publish = asyncio.Event()
        self._no_publish.set()
        # set inside publishing(), and seen by the tasks started there (they copy the context)
        self._in_publish: contextvars.ContextVar[bool] = contextvars.ContextVar(f"publishing-{id(self)}", default=False)
        # Every version passes this check before it is stored (the node's canary residue scan, set by
        # ImageStore): a refused publish writes no version record and no tag.
        self.before_publish: Callable[[ImageVersion], Awaitable[None]] | None = None

    # ---- layers ------------------------------------------------------------------------------------

    async def publish_layer(self, blob: Path) -> tuple[LayerManifest, PutStats]:
        """Upload an EROFS image as chunks (only those the repository lacks) and record its manifest.

        Call inside ``publishing()`` together with the ``publish`` that references the layer.
        """
        digest, chunked, stats = await self.chunks.put_file(blob)
        manifest = LayerManifest(digest=digest, size=chunked.size, chunk_size=chunked.chunk_size, chunks=chunked.chunks)
        if not await self.repo.exists(manifest.key):
            await self.repo.put(manifest.key, manifest.model_dump_json().encode())
        self._layers[digest] = manifest
        return manifest, stats

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[None]:
        """Hold off gc while chunks and layers are uploaded but not yet referenced by a tag.

        A publish waits out a gc that runs (or waits for publishes to end) before it counts itself, so a
        waiting gc never waits for a publish that waits for it. One started inside another (a pull's layer
        conversions, tasks made inside the pull's publish, or a pull inside a build) enters at once while
        any publish is counted: gc cannot be running then, and the outer one may be waiting for it."""
        if not (self._in_publish.get() and self._publishing):
            async with self._gc_lock:
                pass  # no await between this and the count below: a gc cannot slip in
        self._publishing += 1
        self._no_publish.clear()
        token = self._in_publish.set(True)
        try:
            yield
        finally:
            self._in_publish.reset(token)
            self._publishing -= 1
            if not self._publishing:
                self._no_publish.set()

    async def _load(self, model: type[M], key: str, what: str) -> M:
        """A record from the repository: missing is ImageNotFound, malformed is the repository's fault."""
        try:
            return model.model_validate_json(await self.repo.get(key))
        except ObjectNotFound:
            raise ImageNotFound(f"{what} is not in the repository") from None
        except ValidationError as e:
            raise BackendError(f"{what} in the repository is malformed: {e}") from e

    async def layer(self, digest: str) -> LayerManifest:
        if digest in self._layers:
            return self._layers[digest]
        manifest = await self._load(LayerManifest, layer_key(digest), f"layer {digest}")
        if manifest.digest != digest:
            raise BackendError(f"layer manifest {digest} in the repository names another layer")
        self._layers[digest] = manifest
        return manifest

    # ---- versions and tags -------------------------------------------------------------------------

    async def publish(self, version: ImageVersion, owner: str | None = None, *, move: bool = False) -> str:
        """Store a version and point its name at it (owned by tenant ``owner``); returns the version digest.

        ``move``: the name may point at another version already and is moved (a registry reference whose
        tag moved in the registry; the caller checks that the name is a pulled one)."""
        digest = version.digest
        if self.before_publish is not None:
            await self.before_publish(version)
        current = await self.tag(version.name)
        if current is not None and current.digest != digest and not move:
            raise ImageExists(
                f"image {version.name} already exists (version {current.digest[:12]}); "
                "published images are immutable: choose another tag or `dsec image rm` it first"
            )
        for ref in version.layers:
            await self.layer(ref.digest)  # every layer must be in the repository before the version is
        if version.parent is not None:
            await self.version(version.parent)
        await self.repo.put(image_key(digest), version.canonical())
        await self.repo.put(tag_key(version.name), Tag(name=version.name, digest=digest, owner=owner).dump())
        self._versions[digest] = version
        return digest

    async def version(self, digest: str) -> ImageVersion:
        if digest in self._versions:
            return self._versions[digest]
        version = await self._load(ImageVersion, image_key(digest), f"image version {digest}")
        if version.digest != digest:
            raise BackendError(f"image version {digest} in the repository does not hash to its name")
        self._versions[digest] = version
        return version

    async def tag(self, name: str) -> Tag | None:
        try:
            return Tag.model_validate_json(await self.repo.get(tag_key(name)))
        except ObjectNotFound:
            return None
        except ValidationError as e:
            raise BackendError(f"tag {name} in the repository is malformed: {e}") from e

    async def resolve(self, name: str) -> tuple[str, ImageVersion]:
        tag = await self.tag(name)
        if tag is None:
            raise ImageNotFound(f"image {name!r} not found; `dsec image ls` lists the available ones")
        return tag.digest, await self.version(tag.digest)

    async def tags(self) -> list[Tag]:
        found = []
        for key in await self.repo.list("tags/"):
            try:
                found.append(Tag.model_validate_json(await self.repo.get(key)))
            except (ObjectNotFound, ValidationError):
                continue  # removed meanwhile, or not ours
        return sorted(found, key=lambda t: t.name)

    async def history(self, name: str) -> list[tuple[str, ImageVersion]]:
        """The version a name points at, then its parent, grandparent, ... (lineage)."""
        digest, version = await self.resolve(name)
        chain = [(digest, version)]
        seen = {digest}
        while version.parent is not None and version.parent not in seen:
            digest = version.parent
            seen.add(digest)
            try:
                version = await self.version(digest)
            except ImageNotFound:
                break  # a collected ancestor ends the recorded lineage
            chain.append((digest, version))
        return chain

    async def untag(self, name: str, in_use: set[str]) -> str:
        """Free a name; the version stays until gc. Refused while a live sandbox runs on it."""
        tag = await self.tag(name)
        if tag is None:
            raise ImageNotFound(f"image {name!r} not found")
        if tag.digest in in_use:
            raise ImageInUse(f"image {name} is used by a live sandbox; kill it first")
        await self.repo.delete(tag_key(name))
        return tag.digest

    # ---- build cache -------------------------------------------------------------------------------

    async def cached_step(self, key: str) -> CachedStep | None:
        """The layer a build step with this cache key produced before, if it is still there."""
        try:
            cached = CachedStep.model_validate_json(await self.repo.get(f"buildcache/{key}.json"))
        except (ObjectNotFound, ValidationError):
            return None
        try:
            await self.layer(cached.layer.digest)
        except (ImageNotFound, BackendError):
            return None  # collected since: build it again
        return cached

    async def cache_step(self, key: str, cached: CachedStep) -> None:
        await self.repo.put(f"buildcache/{key}.json", cached.model_dump_json().encode())

    # ---- gc ----------------------------------------------------------------------------------------

    async def _gc_registry_layers(self, keep_layers: set[str]) -> None:
        """Forget which EROFS layer a registry layer became once that layer goes: the next pull converts
        it again instead of trusting a record whose layer is gone."""
        for key in await self.repo.list(REGISTRY_LAYERS):
            try:
                layer = RegistryLayer.model_validate_json(await self.repo.get(key)).layer
            except (ObjectNotFound, ValidationError):
                layer = None
            if layer not in keep_layers:
                await self.repo.delete(key)

    async def gc(self, in_use_versions: set[str], in_use_layers: set[str]) -> GcReport:
        """Delete versions, layers and chunks nothing references; never anything in use.

        Kept: every tagged version and its lineage records, every version and layer in use on this
        node, every layer of a kept version, every chunk of a kept layer. A version's layer list is
        complete, so an ancestor's record can be kept for lineage while its unique layers go.
        """
        async with self._gc_lock:
            await self._no_publish.wait()
            report = GcReport()
            tagged = {t.digest for t in await self.tags()}
            live_versions = tagged | in_use_versions
            keep_records: set[str] = set()
            keep_layers = set(in_use_layers)
            for digest in live_versions:
                try:
                    version = await self.version(digest)
                except ImageNotFound:
                    continue
                keep_layers.update(ref.digest for ref in version.layers)
                while digest not in keep_records:
                    keep_records.add(digest)
                    if version.parent is None:
                        break
                    digest = version.parent
                    try:
                        version = await self.version(digest)
                    except ImageNotFound:
                        break
            for key in await self.repo.list("images/"):
                digest = key.removeprefix("images/").removesuffix(".json")
                if digest not in keep_records:
                    await self.repo.delete(key)
                    self._versions.pop(digest, None)
                    report.images_deleted += 1
            keep_chunks: set[str] = set()
            for key in await self.repo.list("layers/"):
                digest = key.removeprefix("layers/").removesuffix(".json")
                if digest in keep_layers:
                    try:
                        keep_chunks.update((await self.layer(digest)).chunks)
                    except (ImageNotFound, BackendError):
                        continue
                    report.kept_layers += 1
                else:
                    await self.repo.delete(key)
                    await self.repo.delete(trace_key(digest))
                    self._layers.pop(digest, None)
                    report.layers_deleted += 1
            await self._gc_registry_layers(keep_layers)
            for key in await self.repo.list("buildcache/"):
                try:
                    cached = CachedStep.model_validate_json(await self.repo.get(key))
                except (ObjectNotFound, ValidationError):
                    await self.repo.delete(key)
                    continue
                if cached.layer.digest not in keep_layers:
                    await self.repo.delete(key)
            for key in await self.repo.list("chunks/"):
                if key.rsplit("/", 1)[-1] in keep_chunks:
                    report.kept_chunks += 1
                    continue
                try:
                    report.bytes_freed += await self.repo.size(key)
                except ObjectNotFound:
                    continue
                await self.repo.delete(key)
                report.chunks_deleted += 1
            report.in_use = sorted(in_use_versions)
            log.info("gc: %s", report)
            return report
