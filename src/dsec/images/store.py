"""The node's image service: names → versions → mounted layers, and everything that makes new versions.

An image resolves to an ``ImageRef``: its version digest, its layers (lowest first) as mounted directories,
and its config. New versions come from built-in builders, snapshots of sandboxes (pack_diff), imports and
pulls; each packs directories into EROFS layers, scrubs residue, uploads only the chunks the repository
lacks, and publishes an immutable version.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendError, DsecError, Forbidden, ImageExists, ImageNotFound, InvalidRequest, RegistryUnreachable
from ..protocol.build import LayerRole
from ..protocol.names import PullPolicy, is_registry_reference, normalize
from ..protocol.sandbox import GcResult, ImageInfo, ImageStats, LayerInfo, LayerStats
from ..tenancy import OPERATOR, Caller
from . import erofs
from .builtin import BUILTIN, RECIPES, Recipe, build_builtin, builtin_names
from .canary import ResidueGuard
from .catalog import Catalog
from .erofs import StagedLayer
from .layers import NodeLayers
from .lazy import Fetcher
from .model import DEFAULT_PATH, ImageConfig, ImageVersion, LayerRef, Tag
from .pull import Puller
from .pull_progress import PullProgress
from .registry import Reference, RegistryOptions, parse_reference
from .repository import open_repository
from .scrub import ScrubRules

log = logging.getLogger("dsec.images")
__all__ = ["BUILTIN", "DEFAULT_PATH", "ImageRef", "ImageStore", "StagedLayer", "normalize"]

DEFAULT_CACHE = 20 << 30


@dataclass(frozen=True)
class ImageRef:
    name: str
    layers: tuple[Path, ...]  # mounted layer directories (or layer files when not mounted), lowest first
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    digest: str = ""
    layer_digests: tuple[str, ...] = ()
    user: str = "root"
    layer_files: tuple[Path, ...] = ()  # each layer's EROFS image as a file (VMs attach them as disks)
    owner: str | None = None  # the tenant whose image it is; None: public
    # a checkpoint's layers as EROFS files, on top of ``layers`` (core/checkpoints.py); the kind mounts them
    stack: tuple[Path, ...] = ()


OWN_NAMESPACE = "dsec/"  # dsec's own images: a name under it never means Docker Hub's


def _not_found(name: str) -> ImageNotFound:
    """The one answer for a missing image and for another tenant's: the two must not be told apart."""
    return ImageNotFound(f"image {name!r} not found; `dsec image ls` lists the available ones")


def check_publishable(name: str, caller: Caller) -> None:
    """Tenants may not publish under dsec/: a built-in name not built yet would otherwise be theirs to plant."""
    if not caller.operator and name.startswith("dsec/"):
        raise Forbidden(f"image names under dsec/ are reserved for the daemon's built-in images: {name}")


def _info(name: str, digest: str, version: ImageVersion, owner: str | None = None) -> ImageInfo:
    return ImageInfo(
        name=name,
        size=version.size,
        created_at=version.created_at,
        ready=True,
        description=version.description,
        digest=digest,
        layers=[LayerInfo(**ref.model_dump(mode="json")) for ref in version.layers],
        parent=version.parent,
        source_sandbox=version.source_sandbox,
        scrubbed=version.scrubbed,
        owner=owner,
    )


class ImageStore:
    def __init__(
        self,
        root: Path,
        repository: str | Path | None = None,
        *,
        lazy: bool = True,
        cache_max: int = DEFAULT_CACHE,
        mount: bool = True,
        scrub: ScrubRules | None = None,
        canaries: Iterable[str] = (),
        registry: RegistryOptions | None = None,
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.repository = str(repository or root / "repository")
        self.catalog = Catalog(open_repository(self.repository))
        self.lazy = lazy and mount
        # the fetcher writes complete layers where the node keeps its local copies (layers.py)
        self.fetcher = (
            Fetcher(root / "fetcher", self.repository, cache_max, complete_dir=root / "blobs") if self.lazy else None
        )
        self.layers = NodeLayers(root, self.catalog, self.fetcher)
        self.mount = mount  # False: layers are handed out as files (unit tests; kinds that attach files)
        self.scrub = scrub or ScrubRules()
        self.residue = ResidueGuard(self.layers, canaries, shared_mounts=mount)
        self.catalog.before_publish = self.residue.check_version
        self._build_locks: dict[str, asyncio.Lock] = {}
        self.recipes: dict[str, Recipe] = {}  # RECIPES' builds, given by the core (they need a builder sandbox)
        self._refs: dict[str, ImageRef] = {}
        self._traced: set[str] = set()
        self._fetcher_lock = asyncio.Lock()
        self.registry = registry if registry is not None else RegistryOptions()
        self.puller = Puller(self, self.registry)

    async def start(self) -> list[str]:
        notes = []
        restarted = False
        if self.fetcher is not None:
            adopted = await self.fetcher.ping() is not None  # still running from before a daemon restart
            await self.fetcher.start()
            restarted = not adopted
            notes.append(f"lazy layers through the fetcher ({'adopted' if adopted else 'started'})")
        else:
            notes.append("layers fetched whole before use (eager)")
        if self.mount:
            await self.layers.start(fetcher_restarted=restarted)
        return notes

    async def close(self, survivors: int) -> list[str]:
        """The daemon stops. With no sandbox left running nothing of the image side stays behind: the
        layer mounts are detached and the fetcher stopped. Sandboxes that outlive the daemon (the next
        one adopts them) keep both, and the note says so."""
        await self.puller.close()
        if not self.mount:
            return []
        if survivors:
            pid = self.fetcher.pid if self.fetcher is not None else None
            serving = f"the layer fetcher (pid {pid}) and " if pid is not None else ""
            return [
                f"{serving}the layer mounts stay for {survivors} sandbox(es) that outlive this daemon "
                "(the next daemon on this state directory adopts them)"
            ]
        detached = await self.layers.detach_all()
        if self.fetcher is not None:
            await self.fetcher.stop()
        return [f"no sandbox left running: {detached} layer mount(s) detached, layer fetcher stopped"]

    # ---- resolving ---------------------------------------------------------------------------------

    async def _check_fetcher(self) -> None:
        """A fetcher that died under a running daemon is replaced, and the layer mounts it served are
        detached so new sandboxes get working ones (running sandboxes see read errors, not zeros)."""
        if self.fetcher is None or self.fetcher.alive():
            return
        async with self._fetcher_lock:
            if self.fetcher.alive():
                return
            log.warning("the layer fetcher is gone: starting a new one and remounting lazy layers")
            await self.fetcher.start()
            self._refs.clear()
            if self.mount:
                await self.layers.start(fetcher_restarted=True)

    async def resolve(
        self,
        name: str,
        *,
        build: bool = True,
        caller: Caller = OPERATOR,
        version: str | None = None,
        pull: PullPolicy = "if-not-present",
    ) -> ImageRef:
        """The image's layers, ready to use; a built-in image is built on first use, a registry image
        pulled as ``pull`` says (protocol/names.py: which names are a registry's). ``version``: that
        version of the name (a trajectory's rebuild runs on what the lost sandbox ran on), not its newest."""
        await self._check_fetcher()
        norm = normalize(name)
        if version is not None:
            current = await self.resolve(name, build=build, caller=caller)
            if current.digest == version:
                return current
            try:
                await self.catalog.version(version)
            except DsecError as e:
                raise ImageNotFound(f"image {name!r} no longer has version {version[:16]}: {e}") from None
            return await self._ref(norm, version, current.owner)
        if is_registry_reference(norm):
            return await self._pulled(norm, caller, pull, build)
        if norm in self._refs:
            cached = self._refs[norm]
            if not caller.sees(cached.owner):
                raise _not_found(norm)
            if self.mount:
                self.layers.switch_complete(cached.layer_digests)
            return cached
        tag = await self.catalog.tag(norm)
        hidden = tag is not None and not caller.sees(tag.owner)
        if (tag is None or hidden) and norm not in BUILTIN and not norm.startswith(OWN_NAMESPACE):
            # a name the caller has no image by is Docker Hub's, as `docker run python:3.11` reads it; one
            # another tenant holds goes there too, so that what others hold cannot be probed
            return await self._pulled(norm, caller, pull, build, short=True)
        if tag is None:
            if not build:
                raise ImageNotFound(f"image {name!r} is not built yet") from None
            # the build outlives the creation that asked for it: that caller may go away (and its
            # creation be cancelled), but a build cut short would start over at the next creation
            building = asyncio.ensure_future(self.ensure(norm))
            building.add_done_callback(_build_done)
            await asyncio.shield(building)
            tag = await self.catalog.tag(norm)
            if tag is None:
                raise _not_found(norm)
        if not caller.sees(tag.owner):
            raise _not_found(norm)
        return await self._cached_ref(norm, tag.digest, tag.owner)

    async def _cached_ref(self, norm: str, digest: str, owner: str | None) -> ImageRef:
        """``_ref``, cached; made again if the fetcher was replaced meanwhile (its mounts were detached)."""
        for _ in range(3):
            replaced = self.layers.generation  # counted where the mounts are detached (NodeLayers.start)
            ref = await self._ref(norm, digest, owner)
            if replaced == self.layers.generation:
                self._refs[norm] = ref
                return ref
        raise BackendError(f"the layer fetcher was replaced three times while {norm} was mounted")

    async def _pulled(
        self, name: str, caller: Caller, policy: PullPolicy, build: bool, *, short: bool = False
    ) -> ImageRef:
        """A registry image's layers, pulled first unless the node has it and ``policy`` lets it stand."""
        parsed = parse_reference(name)
        canonical = str(parsed)
        if policy == "if-not-present" and canonical in self._refs:
            return self._refs[canonical]
        if short and not self.registry.allows(parsed.registry):  # answered at once: no registry is asked
            raise ImageNotFound(f"image {name!r} not found on this node (Docker Hub is not allowed here)")
        if not build and await self.catalog.tag(canonical) is None:
            raise ImageNotFound(f"image {name!r} is not pulled yet")
        try:
            info = await self.pull(canonical, owner=caller.owner, policy=policy)
        except (ImageNotFound, RegistryUnreachable) as e:
            if not short:
                raise
            # a short name found nowhere the node can look: not found, whatever the reason (logged)
            log.info("%s is not on this node and Docker Hub did not give it: %s", name, e.message)
            reached = "or on Docker Hub" if isinstance(e, ImageNotFound) else "(Docker Hub could not be reached)"
            raise ImageNotFound(f"image {name!r} not found on this node {reached}") from e
        tag = await self.catalog.tag(canonical)
        if tag is None or tag.digest != info.digest:
            raise _not_found(canonical)  # removed again between the pull and now
        return await self._cached_ref(canonical, tag.digest, tag.owner)

    async def _ref(self, norm: str, digest: str, owner: str | None) -> ImageRef:
        version = await self.catalog.version(digest)
        digests = tuple(ref.digest for ref in version.layers)
        if self.mount:
            layers = tuple(await asyncio.gather(*(self.layers.mount(d) for d in digests)))
        else:
            layers = tuple(self.layers.blobs / d for d in digests)
        ref = ImageRef(
            name=norm,
            layers=layers,
            env=dict(version.config.env),
            workdir=version.config.workdir,
            digest=digest,
            layer_digests=digests,
            user=version.config.user,
            layer_files=tuple(self.layers.file(d) for d in digests),
            owner=owner,
        )
        return ref

    async def ensure(self, name: str, caller: Caller = OPERATOR) -> ImageInfo:
        """Build a built-in image unless it is published already."""
        norm = normalize(name)
        async with self._build_locks.setdefault(norm, asyncio.Lock()):
            tag = await self.catalog.tag(norm)
            if tag is None or not caller.sees(tag.owner):
                if norm not in builtin_names() or tag is not None:
                    raise ImageNotFound(f"image {name!r} not found and not a built-in image")
                started = time.monotonic()
                log.info("building image %s (%s)", norm, builtin_names()[norm])
                if norm in RECIPES:
                    await self.recipes[norm]()
                else:
                    await build_builtin(self, norm)
                log.info("built image %s in %.1fs", norm, time.monotonic() - started)
        return await self.info(norm, caller)

    # ---- packing and publishing --------------------------------------------------------------------

    async def pack(
        self, src: Path, rules: ScrubRules | None, *, drop_devices: bool = False, into: Path | None = None
    ) -> StagedLayer:
        """Scan and pack a directory (overlayfs format) into an EROFS image in ``into`` or the node's disk."""
        started = time.monotonic()
        scanned = await asyncio.to_thread(erofs.scan, src, rules, drop_devices=drop_devices)
        blob = (into or self.layers.tmp) / f"pack-{secrets.token_hex(8)}.erofs"
        await erofs.mkfs(src, blob, scanned)
        return StagedLayer(blob=blob, scan=scanned, seconds=time.monotonic() - started)

    async def publish_layer(self, staged: StagedLayer, role: LayerRole, by: str, *, keep: bool = True) -> LayerRef:
        """Publish a packed layer, its file kept as this node's copy (``keep``) or else read via the fetcher."""
        try:
            await self.residue.check_staged(staged.blob)  # before a single chunk of it is uploaded
            manifest, _stats = await self.catalog.publish_layer(staged.blob)
        except BaseException:
            staged.blob.unlink(missing_ok=True)
            raise
        if keep:
            self.layers.adopt_blob(staged.blob, manifest.digest)  # sandboxes on this node start without a fetch
        else:
            staged.blob.unlink(missing_ok=True)
        return LayerRef(digest=manifest.digest, role=role, size=manifest.size, created_by=by)

    async def check_free(self, name: str, caller: Caller = OPERATOR) -> str:
        """Fail early, before a sandbox is frozen, if a new version could not take this name.

        A name another tenant holds is answered like any taken name, without saying whose it is.
        """
        norm = normalize(name)
        check_publishable(norm, caller)
        tag = await self.catalog.tag(norm)
        if tag is not None:
            raise ImageExists(f"image {norm} already exists; published images are immutable: choose another tag")
        return norm

    async def publish_diff(
        self,
        staged: StagedLayer,
        *,
        name: str,
        parent: ImageRef,
        source_sandbox: str,
        description: str = "",
        owner: str | None = None,
    ) -> ImageInfo:
        """pack_diff's second half: the sandbox's staged upper layer on top of its image, as a new version."""
        norm = normalize(name)
        parent_version = await self.catalog.version(parent.digest)
        async with self.catalog.publishing():
            layers = list(parent_version.layers)
            if staged.scan.entries:
                layers.append(await self.publish_layer(staged, LayerRole.diff, f"snapshot of {source_sandbox}"))
            else:
                staged.blob.unlink(missing_ok=True)  # nothing changed: the new version shares every layer
            version = ImageVersion(
                name=norm,
                layers=layers,
                config=parent_version.config,
                parent=parent.digest,
                source_sandbox=source_sandbox,
                description=description or f"snapshot of {source_sandbox} on {parent.name}",
                scrubbed=staged.scan.scrubbed,
            )
            digest = await self.catalog.publish(version, owner)
        return _info(norm, digest, version, owner)

    async def publish_layers(
        self,
        name: str,
        staged: list[tuple[StagedLayer, LayerRole, str]],
        *,
        config: ImageConfig | None = None,
        parent: str | None = None,
        description: str = "",
        owner: str | None = None,
    ) -> ImageInfo:
        """A new version made of freshly packed layers (imports)."""
        norm = await self.check_free(name)
        async with self.catalog.publishing():
            refs = [await self.publish_layer(s, role, by) for s, role, by in staged]
            scrubbed = [p for s, _, _ in staged for p in s.scan.scrubbed]
            return await self.publish_version(
                norm, refs, config=config, parent=parent, description=description, scrubbed=scrubbed, owner=owner
            )

    async def publish_version(
        self,
        name: str,
        layers: builtins.list[LayerRef],
        *,
        config: ImageConfig | None = None,
        parent: str | None = None,
        description: str = "",
        scrubbed: builtins.list[str] | None = None,
        owner: str | None = None,
    ) -> ImageInfo:
        """Publish layers already in the repository as a new version named ``name`` (call in publishing())."""
        norm = normalize(name)
        version = ImageVersion(
            name=norm,
            layers=layers,
            config=config or ImageConfig(),
            parent=parent,
            description=description,
            scrubbed=scrubbed or [],
        )
        digest = await self.catalog.publish(version, owner)
        return _info(norm, digest, version, owner)

    async def import_image(self, path: str, name: str, reference: str | None = None) -> ImageInfo:
        """Import an OCI image layout directory or a `docker save` tarball on this node as a new image."""
        from . import oci

        norm = await self.check_free(name)
        src = Path(path)
        if not src.is_absolute():
            raise InvalidRequest(f"import path {path!r} must be absolute (it is read on the daemon's node)")
        try:
            found = await asyncio.to_thread(src.exists)
        except OSError as e:  # a name too long, a file where a directory should be, ...
            raise oci.unreadable(src, e) from None
        if not found:
            raise InvalidRequest(f"nothing to import at {path} on the daemon's node")
        image = await asyncio.to_thread(oci.read_image, src, reference=reference)
        work = self.layers.tmp / f"import-{secrets.token_hex(4)}"
        staged: list[tuple[StagedLayer, LayerRole, str]] = []
        try:
            for i, layer in enumerate(image.layers):
                dest = work / f"layer-{i}"
                dest.mkdir(parents=True)
                await asyncio.to_thread(oci.extract_layer, layer, dest)
                # each layer scrubbed on its own: residue a later layer deletes is still gone from this one
                packed = await self.pack(dest, self.scrub, drop_devices=True)
                role = LayerRole.base if i == 0 else LayerRole.toolkit
                staged.append((packed, role, f"import of {src.name}, layer {i + 1}/{len(image.layers)}"))
                await asyncio.to_thread(shutil.rmtree, dest, True)
            return await self.publish_layers(norm, staged, config=image.config, description=f"imported from {src}")
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
            for packed, _, _ in staged:
                packed.blob.unlink(missing_ok=True)  # published ones were moved to blobs/ already

    # ---- registries --------------------------------------------------------------------------------

    async def pull(
        self,
        ref: str | Reference,
        *,
        owner: str | None = None,
        policy: PullPolicy = "if-not-present",
        progress: Callable[[PullProgress], None] | None = None,
    ) -> ImageInfo:
        """A registry image as a version named by its canonical reference (pull.py says how).

        The name is public whoever pulls it: its content is what the registry serves to this node's
        credentials, which any tenant of the node may name; ``owner`` (the tenant asking) goes in the
        description, and a name another tenant published is not handed to it (``image_exists``)."""
        parsed = ref if isinstance(ref, Reference) else parse_reference(ref)
        if not self.registry.allows(parsed.registry):  # answered at once: no registry is asked
            raise Forbidden(f"this node does not pull from {parsed.registry} (dsec serve --registry-allow)")
        got = await self.puller.pull(parsed, owner=owner, policy=policy, progress=progress)
        cached = self._refs.get(got.name)
        if cached is not None and cached.digest != got.digest:
            del self._refs[got.name]  # the name moved with its registry tag
        return _info(got.name, got.digest, got.version, got.owner)

    def pulling(self, ref: str | Reference) -> PullProgress | None:
        """The pull of ``ref`` in progress on this node, if any: ``.waiting_for()`` says what it waits for."""
        try:
            name = normalize(str(ref if isinstance(ref, Reference) else parse_reference(ref)))
        except DsecError:
            return None
        found = self.puller.active.get(name)
        return found.snapshot() if found is not None else None

    # ---- listing, history, removal, gc, stats ------------------------------------------------------

    async def _visible(self, norm: str, caller: Caller) -> Tag:
        """The tag of an image the caller may see; a missing one and another tenant's answer alike."""
        tag = await self.catalog.tag(norm)
        if tag is None or not caller.sees(tag.owner):
            raise _not_found(norm)
        return tag

    async def info(self, name: str, caller: Caller = OPERATOR) -> ImageInfo:
        norm = normalize(name)
        tag = await self.catalog.tag(norm)
        if tag is None or not caller.sees(tag.owner):
            if norm in builtin_names() and tag is None:
                return ImageInfo(name=norm, size=0, ready=False, description=builtin_names()[norm])
            raise _not_found(norm)
        return _info(norm, tag.digest, await self.catalog.version(tag.digest), tag.owner)

    async def list(self, caller: Caller = OPERATOR) -> list[ImageInfo]:
        found = {}
        for tag in await self.catalog.tags():
            if not caller.sees(tag.owner):
                continue
            with contextlib.suppress(ImageNotFound):
                found[tag.name] = _info(tag.name, tag.digest, await self.catalog.version(tag.digest), tag.owner)
        for name, description in builtin_names().items():
            found.setdefault(name, ImageInfo(name=name, size=0, ready=False, description=description))
        return [found[n] for n in sorted(found)]

    async def history(self, name: str, caller: Caller = OPERATOR) -> builtins.list[ImageInfo]:
        """Lineage, newest first; ``owner`` is known for the name's own version only (versions carry none)."""
        norm = normalize(name)
        tag = await self._visible(norm, caller)
        chain = await self.catalog.history(norm)
        return [_info(v.name, d, v, tag.owner if d == tag.digest else None) for d, v in chain]

    async def remove(self, name: str, in_use: set[str], caller: Caller = OPERATOR) -> None:
        norm = normalize(name)
        tag = await self._visible(norm, caller)
        if not caller.owns(tag.owner):
            raise Forbidden(f"image {norm} is public (built-in or the operator's): only the operator removes it")
        await self.catalog.untag(norm, in_use)
        self._refs.pop(norm, None)

    async def gc(self, in_use_versions: set[str]) -> GcResult:
        in_use_layers: set[str] = set()
        for digest in in_use_versions:
            with contextlib.suppress(ImageNotFound):
                in_use_layers.update(r.digest for r in (await self.catalog.version(digest)).layers)
        report = await self.catalog.gc(in_use_versions, in_use_layers)
        still_there = {
            key.removeprefix("layers/").removesuffix(".json") for key in await self.catalog.repo.list("layers/")
        }
        if self.mount:
            await self.layers.unmount_unused(still_there | in_use_layers)
        self._refs.clear()
        # versions whose traces were saved: those the gc deleted are gone for good (forgetting one that
        # is kept costs a call the fetcher ignores: it keeps a layer's first trace)
        self._traced.clear()
        return GcResult(
            images_deleted=report.images_deleted,
            layers_deleted=report.layers_deleted,
            chunks_deleted=report.chunks_deleted,
            bytes_freed=report.bytes_freed,
            kept_layers=report.kept_layers,
            kept_chunks=report.kept_chunks,
            in_use=report.in_use,
        )

    async def stats(self, name: str, caller: Caller = OPERATOR) -> ImageStats:
        """How much of the image this node has fetched, and how reads fared."""
        norm = normalize(name)
        await self._visible(norm, caller)
        _digest, version = await self.catalog.resolve(norm)
        per_layer = await self.fetcher.stats() if self.fetcher is not None else {}
        fields = set(LayerStats.model_fields) - {"digest", "size"}
        layers = []
        for ref in version.layers:
            s = per_layer.get(ref.digest)
            if isinstance(s, dict):
                counters = {k: v for k, v in s.items() if k in fields}
                layers.append(LayerStats(digest=ref.digest, size=ref.size, **counters))
            else:
                local = (self.layers.blobs / ref.digest).exists()
                layers.append(LayerStats(digest=ref.digest, size=ref.size, fetched_bytes=ref.size if local else 0))
        fetched = sum(s.fetched_bytes for s in layers)
        hits = sum(s.chunk_hits for s in layers)
        misses = sum(s.chunk_misses for s in layers)
        return ImageStats(
            name=norm,
            size=version.size,
            fetched_bytes=fetched,
            exposed_fraction=fetched / version.size if version.size else 0.0,
            chunk_hit_rate=hits / (hits + misses) if hits + misses else None,
            fetch_wait_seconds=sum(s.fetch_wait_seconds for s in layers),
            mode="lazy" if self.fetcher is not None else "eager",
            layers=layers,
        )

    async def save_traces(self, version_digest: str) -> None:
        """Record which chunks a first run read, so later starts of the image prefetch them (the fetcher
        keeps the first trace stored for a layer and ignores later ones)."""
        if self.fetcher is None or not version_digest or version_digest in self._traced:
            return
        self._traced.add(version_digest)
        try:
            version = await self.catalog.version(version_digest)
            for ref in version.layers:
                if not (self.layers.blobs / ref.digest).exists():  # packed here: nothing was fetched
                    await self.fetcher.save_trace(ref.digest)
        except Exception as e:  # a trace is an optimisation: never let it fail a kill
            log.warning("could not save access traces of %s: %s", version_digest[:12], e)


def _build_done(task: asyncio.Task[ImageInfo]) -> None:
    """Say how a build ended that its caller may no longer wait for."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.warning("building an image failed: %s", e)
