"""The registry client: manifests, image configs and blobs of an image reference.

:meth:`RegistryClient.resolve` is what a pull starts with: the reference's manifest (by its digest when it
pins one, else by its tag), narrowed to one platform when it is an index, then the image's config, each
checked against its digest. Blobs then stream (:meth:`RegistryClient.blob_chunks`) or download to a file
(:meth:`RegistryClient.download_blob`).

Every document is verified: its sha256 against the registry's ``Docker-Content-Digest``, against the digest
the reference pins or the index names, and against the descriptor's size. A mirror is tried before its
registry; whatever a mirror fails at (missing content, refused credentials, wrong content, no connection)
is tried again at the next endpoint, and only the registry's own failure is raised.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx

from ...errors import DigestMismatch, DsecError, ImageNotFound, InvalidRequest, NotFound, RegistryError
from .auth import CredentialStore
from .blobs import BlobDownload, BlobProgress, Progress, blob_chunks, download_blob
from .hosts import Endpoint, RegistryHosts
from .manifest import (
    ACCEPT,
    LINUX_AMD64,
    MAX_DOCUMENT,
    Descriptor,
    Document,
    ImageConfigFile,
    ImageManifest,
    Platform,
    parse_config,
    parse_document,
    select_platform,
)
from .reference import Reference, check_digest
from .transport import RegistryAnswer, RetryPolicy, Timeouts, Transport

__all__ = ["FetchedManifest", "RegistryClient", "ResolvedImage"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOB = 64 << 30  # a blob bound when the caller states none: larger than any sane layer
_MAX_NESTING = 3  # indexes inside indexes, as some tools write them
_T = TypeVar("_T")


@dataclass(frozen=True)
class FetchedManifest:
    """One manifest or index as served, verified."""

    reference: Reference  # what was asked for, pinned to the digest it was found to have
    digest: str
    media_type: str
    data: bytes
    document: Document
    served_by: str


@dataclass(frozen=True)
class ResolvedImage:
    """An image for one platform: its manifest, its config, and how it was reached."""

    reference: Reference  # pinned to the platform manifest's digest
    index_digest: str | None  # the index (manifest list) it was chosen from, if any
    digest: str
    media_type: str
    manifest: ImageManifest
    config: ImageConfigFile
    config_data: bytes
    platform: Platform


def _scope(ref: Reference) -> str:
    return f"repository:{ref.repository}:pull"


def _sha(algorithm: str, data: bytes) -> str | None:
    if algorithm == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if algorithm == "sha512":
        return "sha512:" + hashlib.sha512(data).hexdigest()
    return None


def _manifest_not_found(ref: Reference, wanted: str, endpoint: Endpoint) -> Callable[[RegistryAnswer], DsecError]:
    def make(answer: RegistryAnswer) -> DsecError:
        if "NAME_UNKNOWN" in answer.codes:
            return ImageNotFound(f"{endpoint.label()} has no repository {ref.repository} (looking for {ref})")
        kind = "digest" if wanted.startswith("sha256:") else "tag"
        return ImageNotFound(f"{endpoint.label()} has no {kind} {wanted} in repository {ref.repository} ({ref})")

    return make


class RegistryClient:
    """An async client for Distribution (Docker Registry HTTP API v2) registries; use ``async with`` or
    :meth:`aclose`. ``transport`` replaces the network (tests answer requests in-process with one)."""

    def __init__(
        self,
        *,
        hosts: RegistryHosts | None = None,
        credentials: CredentialStore | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        max_blob: int = DEFAULT_MAX_BLOB,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.hosts = hosts if hosts is not None else RegistryHosts()
        self.max_blob = max_blob
        self._http = Transport(
            self.hosts,
            credentials if credentials is not None else CredentialStore(),
            timeouts=timeouts if timeouts is not None else Timeouts(),
            retry=retry if retry is not None else RetryPolicy(),
            transport=transport,
        )

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def transport(self) -> Transport:
        """The HTTP side (a push writes through it: push.py)."""
        return self._http

    async def _each_endpoint(self, ref: Reference, op: Callable[[Endpoint], Awaitable[_T]]) -> _T:
        """``op`` on the first endpoint that does it: mirrors in order, then the registry, whose error stands."""
        endpoints = self.hosts.endpoints(ref.registry)
        for endpoint in endpoints[:-1]:
            try:
                return await op(endpoint)
            except (RegistryError, NotFound) as e:
                log.warning("%s; trying the next endpoint for %s", e, ref.registry)
        return await op(endpoints[-1])

    # ---- manifests -------------------------------------------------------------------------------------

    async def fetch_manifest(self, ref: Reference, wanted: str | None = None) -> FetchedManifest:
        """The manifest or index ``wanted`` (a tag or a digest; the reference's own by default), verified."""
        wanted = wanted if wanted is not None else ref.wanted
        return await self._each_endpoint(ref, lambda endpoint: self._manifest_from(endpoint, ref, wanted))

    async def _manifest_from(self, endpoint: Endpoint, ref: Reference, wanted: str) -> FetchedManifest:
        what = f"manifest {wanted} of {ref.name}"
        data, headers = await self._http.fetch(
            endpoint,
            f"/v2/{ref.repository}/manifests/{wanted}",
            scope=_scope(ref),
            headers={"Accept": ACCEPT},
            what=what,
            limit=MAX_DOCUMENT,
            not_found=_manifest_not_found(ref, wanted, endpoint),
        )
        where = f"{what} from {endpoint.label()}"
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if wanted.startswith("sha256:") and digest != wanted:
            raise DigestMismatch(f"{where} has digest {digest}, not the {wanted} it was asked for: refused")
        said = headers.get("docker-content-digest")
        # the registry's word for what it sent (asked by tag, the only check there is): the content's digest
        if said and _sha(said.partition(":")[0], data) not in (None, said):
            raise DigestMismatch(f"{where} has digest {digest}, but the registry says {said}: refused")
        document = parse_document(data, headers.get("content-type", ""), where)
        pinned = Reference(ref.registry, ref.repository, ref.tag, digest)
        return FetchedManifest(pinned, digest, document.media_type, data, document, endpoint.label())

    async def resolve(
        self, ref: Reference, platform: Platform = LINUX_AMD64, *, top: FetchedManifest | None = None
    ) -> ResolvedImage:
        """``ref``'s image for ``platform``: the manifest (chosen from an index if need be) and its config.
        ``top``: ``ref``'s own manifest or index, fetched already (a pull that first checked whether it moved)."""
        fetched = top if top is not None else await self.fetch_manifest(ref)
        index_digest: str | None = None
        for _ in range(_MAX_NESTING):
            index = fetched.document.index
            if index is None:
                break
            index_digest = index_digest or fetched.digest
            desc = select_platform(index, platform, f"{ref} (index {fetched.digest})")
            check_digest(desc.digest, f"the {platform} entry of {ref}")
            fetched = await self.fetch_manifest(ref, desc.digest)
            if len(fetched.data) != desc.size:
                raise DigestMismatch(
                    f"manifest {desc.digest} of {ref} is {len(fetched.data)} bytes; its index says {desc.size}"
                )
        manifest = fetched.document.manifest
        if manifest is None:
            raise RegistryError(f"indexes of {ref} are nested more than {_MAX_NESTING} deep")
        config_data = await self.fetch_blob(fetched.reference, manifest.config, limit=MAX_DOCUMENT)
        config = parse_config(config_data, f"config {manifest.config.digest} of {ref}")
        _check_config(config, manifest, platform, str(ref))
        return ResolvedImage(
            reference=fetched.reference,
            index_digest=index_digest,
            digest=fetched.digest,
            media_type=fetched.media_type,
            manifest=manifest,
            config=config,
            config_data=config_data,
            platform=platform,
        )

    # ---- blobs -----------------------------------------------------------------------------------------

    async def fetch_blob(self, ref: Reference, desc: Descriptor, *, limit: int = MAX_DOCUMENT) -> bytes:
        """A small blob (a config) whole, verified against ``desc``'s digest and size."""
        parts = [chunk async for chunk in self.blob_chunks(ref, desc, max_size=limit)]
        return b"".join(parts)

    def blob_chunks(
        self,
        ref: Reference,
        desc: Descriptor,
        *,
        max_size: int | None = None,
        progress: Progress | None = None,
        stats: BlobProgress | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The bytes of blob ``desc`` as they arrive, resumed across dropped connections; DigestMismatch
        after the last chunk if they are not what the digest names (see blobs.py)."""
        limit = self.max_blob if max_size is None else max_size
        return blob_chunks(self._http, ref, desc, max_size=limit, progress=progress, stats=stats)

    async def download_blob(
        self,
        ref: Reference,
        desc: Descriptor,
        dest: Path,
        *,
        max_size: int | None = None,
        progress: Progress | None = None,
    ) -> BlobDownload:
        """Blob ``desc`` into the file ``dest``, verified; nothing is left behind on failure."""
        limit = self.max_blob if max_size is None else max_size
        return await download_blob(self._http, ref, desc, dest, max_size=limit, progress=progress)


def _check_config(config: ImageConfigFile, manifest: ImageManifest, platform: Platform, ref: str) -> None:
    if (config.os and config.os != platform.os) or (
        config.architecture and config.architecture != platform.architecture
    ):
        found = "/".join(p for p in (config.os, config.architecture, config.variant) if p)
        raise InvalidRequest(f"{ref} is a {found} image, not {platform}")
    if config.rootfs is not None and len(config.rootfs.diff_ids) != len(manifest.layers):
        raise RegistryError(
            f"the config of {ref} lists {len(config.rootfs.diff_ids)} layer diff_ids for {len(manifest.layers)} layers"
        )
