"""Images users already have: an OCI image layout directory or a ``docker save`` archive, read from disk.

:func:`read_image` picks one image (by reference, or linux/amd64 from a multi-platform index), checks
every blob it uses against its sha256 digest and returns the image config plus the layers, each able to
reopen its tar stream. :func:`extract_layer` turns one layer into a directory in overlayfs's format
(see tar_extract.py), checking the digests again as it streams: a source that changed in between is
refused.

Sources: an OCI layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/``), the same as a
plain or gzip-compressed tar (an "oci-archive"), and ``docker save`` output, both the legacy format
(``manifest.json``, ``<id>/layer.tar``) and the Docker 25+ one that embeds an OCI layout, as a tar,
a gzip-compressed tar or an unpacked directory.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import BackendError, DsecError, InvalidRequest, validation_message
from .layer_stream import (
    GZIP_MAGIC,
    READ_ERRORS,
    Compression,
    HashingReader,
    check_compression,
    decompress,
    read_failure,
    sniff,
)
from .model import DEFAULT_PATH, ImageConfig
from .oci_source import DirStore, Store, TarStore, norm
from .tar_extract import ExtractStats, extract_tar

__all__ = ["LAYER_TYPES", "ExtractStats", "LayerSource", "OciImage", "extract_layer", "image_config", "read_image"]

PLATFORM = ("linux", "amd64")  # what dsec's sandboxes run
MAX_JSON = 8 << 20  # manifests, indexes and configs are small; refuse to buffer anything bigger
REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"
INDEX_TYPES = {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
MANIFEST_TYPES = {"application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"}
CONFIG_TYPES = {"application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"}
LAYER_TYPES: dict[str, Compression] = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
# where a docker save archive names a blob by its digest: "blobs/sha256/<hex>" (Docker 25+) or "<hex>.json"
_PATH_DIGEST = re.compile(r"(?:.*/)?(?:blobs/sha256/([0-9a-f]{64})|([0-9a-f]{64})\.json)")


@dataclass(frozen=True)
class LayerSource:
    """One layer of an image being imported, and how to reopen its blob."""

    digest: str | None  # "sha256:…" of the blob as stored; None for a legacy docker-save layer (named by id)
    diff_id: str | None  # "sha256:…" of the uncompressed tar, from the image config
    media_type: str
    size: int
    compression: Compression
    where: str  # for messages: the blob's path and the source it is in
    opener: Callable[[], BinaryIO] = field(repr=False, compare=False)


@dataclass(frozen=True)
class OciImage:
    config: ImageConfig
    layers: list[LayerSource]
    source_ref: str | None  # the name the chosen image carries in the source, if any
    manifest_digest: str | None = None  # None for a legacy docker save, which has no manifest blob


# ---- reading the source ---------------------------------------------------------------------------


# errors that say the path given is no readable file (the caller's to fix), not that the node failed
_BAD_PATH = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO})


def unreadable(source: Path, e: OSError) -> DsecError:
    if isinstance(e, FileNotFoundError):
        return InvalidRequest(f"nothing to import at {source}")
    cls = InvalidRequest if e.errno in _BAD_PATH else BackendError
    return cls(f"cannot read {source}: {e.strerror}")


def _open_source(source: Path) -> Store:
    try:
        if source.is_dir():
            return DirStore(source)
        with open(source, "rb") as f:
            magic = f.read(2)
    except OSError as e:
        raise unreadable(source, e) from None
    return TarStore(source, gz=magic == GZIP_MAGIC)


def _read_small(store: Store, name: str, what: str) -> bytes:
    try:
        with store.open(name) as f:
            data = f.read(MAX_JSON + 1)
    except READ_ERRORS as e:
        raise read_failure(e, f"{what} in {store.label}") from None
    if len(data) > MAX_JSON:
        raise InvalidRequest(f"{what} ({name} in {store.label}) is larger than {MAX_JSON} bytes")
    return data


def _hash_blob(store: Store, name: str, compression: Compression | None = None) -> HashingReader:
    """Read a blob to its end through sha256; with ``compression``, hash its decompressed content instead."""
    what = f"{name} in {store.label}"
    try:
        with store.open(name) as f:
            raw = HashingReader(f)
            if compression is None:
                raw.drain()
                return raw
            plain = HashingReader(decompress(raw, compression))
            plain.drain()
            return plain
    except READ_ERRORS as e:
        raise read_failure(e, what) from None


# ---- documents -------------------------------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class _Platform(_Doc):
    os: str = ""
    architecture: str = ""
    variant: str = ""

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


class _Descriptor(_Doc):
    media_type: str = Field("", alias="mediaType")
    digest: str
    size: int = Field(ge=0)
    annotations: dict[str, str] = Field(default_factory=dict)
    platform: _Platform | None = None


class _Document(_Doc):
    """An index (``manifests``) or an image manifest (``config``, ``layers``)."""

    media_type: str = Field("", alias="mediaType")
    manifests: list[_Descriptor] | None = None
    config: _Descriptor | None = None
    layers: list[_Descriptor] = Field(default_factory=list)


class _RunConfig(_Doc):
    env: list[str] | None = Field(None, alias="Env")
    entrypoint: list[str] | None = Field(None, alias="Entrypoint")
    cmd: list[str] | None = Field(None, alias="Cmd")
    working_dir: str | None = Field(None, alias="WorkingDir")
    user: str | None = Field(None, alias="User")
    labels: dict[str, str] | None = Field(None, alias="Labels")
    exposed_ports: dict[str, object] | None = Field(None, alias="ExposedPorts")


class _RootFs(_Doc):
    diff_ids: list[str] = Field(default_factory=list)


class _ConfigFile(_Doc):
    os: str = ""
    architecture: str = ""
    config: _RunConfig | None = None
    rootfs: _RootFs | None = None


class _DockerEntry(_Doc):
    config: str = Field(alias="Config")
    repo_tags: list[str] | None = Field(None, alias="RepoTags")
    layers: list[str] = Field(alias="Layers")


class _Layout(_Doc):
    version: str = Field(alias="imageLayoutVersion")


_M = TypeVar("_M", bound=BaseModel)


def _parse(cls: type[_M], data: bytes, what: str) -> _M:
    try:
        return cls.model_validate_json(data)
    except ValidationError as e:
        raise InvalidRequest(f"{what} is not valid: {validation_message(e)}") from None


def _blob_name(digest: str, what: str) -> str:
    m = _DIGEST.fullmatch(digest)
    if m is None:
        algo = digest.partition(":")[0]
        if algo in ("sha384", "sha512"):
            raise InvalidRequest(f"{what} uses digest algorithm {algo}, which is not supported (sha256 only)")
        raise InvalidRequest(f"{what} has an invalid digest {digest!r}")
    return f"blobs/sha256/{m[1]}"


def _read_blob(store: Store, desc: _Descriptor, what: str) -> bytes:
    name = _blob_name(desc.digest, what)
    if desc.size > MAX_JSON:
        raise InvalidRequest(f"{what} {desc.digest} claims {desc.size} bytes, over the {MAX_JSON}-byte limit")
    data = _read_small(store, name, what)
    _check_digest(hashlib.sha256(data).hexdigest(), len(data), desc.digest, desc.size, f"{what} ({name})", store)
    return data


def _check_digest(got_hex: str, got_size: int, digest: str, size: int | None, what: str, store: Store) -> None:
    if size is not None and got_size != size:
        raise InvalidRequest(f"{what} in {store.label} is {got_size} bytes, but its descriptor says {size}")
    if "sha256:" + got_hex != digest:
        raise InvalidRequest(f"{what} in {store.label} does not match its digest {digest} (got sha256:{got_hex})")


# ---- choosing the image ----------------------------------------------------------------------------


def _normalize_ref(ref: str) -> str:
    """Docker's familiar form: "docker.io/library/foo" and "foo" are both "foo:latest"."""
    for prefix in ("docker.io/", "index.docker.io/"):
        ref = ref.removeprefix(prefix)
    ref = ref.removeprefix("library/")
    if "@" not in ref and ":" not in ref.rsplit("/", 1)[-1]:
        ref += ":latest"
    return ref


def _matches(reference: str, names: list[str]) -> bool:
    want = {reference, _normalize_ref(reference)}
    return any(n in want or _normalize_ref(n) in want for n in names)


def _desc_names(d: _Descriptor) -> list[str]:
    return [d.annotations[k] for k in (REF_NAME, CONTAINERD_NAME) if k in d.annotations]


def _is_attestation(d: _Descriptor) -> bool:
    # BuildKit stores provenance/SBOM documents as extra "unknown/unknown" manifests in an index
    return d.annotations.get("vnd.docker.reference.type") == "attestation-manifest" or (
        d.platform is not None and d.platform.os == "unknown"
    )


def _select(descs: list[_Descriptor], reference: str | None, label: str) -> _Descriptor:
    """The descriptor in a layout's index.json that names the image to import."""
    usable = [d for d in descs if not _is_attestation(d)]
    choices = sorted({(_desc_names(d) or [d.digest])[0] for d in usable})
    if reference is not None:
        usable = [d for d in usable if _matches(reference, [*_desc_names(d), d.digest])]
        if not usable:
            raise InvalidRequest(f"no image {reference!r} in {label}; it holds: {', '.join(choices) or 'nothing'}")
    if not usable:
        raise InvalidRequest(f"{label} holds no image")
    usable = list({d.digest: d for d in usable}.values())  # one manifest under several names is one image
    if len(usable) == 1:
        return usable[0]
    names = {d.annotations.get(REF_NAME) for d in usable}
    if len(names) > 1 or not all(d.platform for d in usable):
        raise InvalidRequest(f"{label} holds several images; choose one with reference=: {', '.join(choices)}")
    return _pick_platform(usable, label)  # one name, several platforms


def _pick_platform(descs: list[_Descriptor], label: str) -> _Descriptor:
    usable = [d for d in descs if not _is_attestation(d)]
    if len(usable) == 1 and usable[0].platform is None:
        return usable[0]
    hits = [d for d in usable if d.platform is not None and (d.platform.os, d.platform.architecture) == PLATFORM]
    if not hits:
        found = ", ".join(str(d.platform) if d.platform else "unspecified" for d in usable) or "none"
        raise InvalidRequest(f"{label} has no {'/'.join(PLATFORM)} image (platforms: {found})")
    # no variant first: amd64 "v3" images need newer CPUs than the baseline
    return min(hits, key=lambda d: d.platform.variant if d.platform else "")


def _resolve(store: Store, desc: _Descriptor) -> tuple[_Descriptor, _Descriptor, list[_Descriptor]]:
    """Follow nested indexes (multi-platform images) down to one image manifest: (it, config, layers)."""
    for _ in range(4):
        doc = _parse(_Document, _read_blob(store, desc, "manifest"), f"manifest {desc.digest}")
        # the descriptor may omit the media type; then the document says, or its shape does
        media = desc.media_type or doc.media_type
        if media in INDEX_TYPES or (not media and doc.manifests is not None):
            desc = _pick_platform(doc.manifests or [], f"index {desc.digest}")
            continue
        if doc.config is None or (media and media not in MANIFEST_TYPES):
            raise InvalidRequest(f"{desc.digest} in {store.label} is a {media or 'document'!r}, not an image manifest")
        return desc, doc.config, doc.layers
    raise InvalidRequest(f"indexes in {store.label} are nested too deeply")


# ---- the image -------------------------------------------------------------------------------------


def _image_config(cfg: _ConfigFile, what: str) -> ImageConfig:
    if (cfg.os and cfg.os != PLATFORM[0]) or (cfg.architecture and cfg.architecture != PLATFORM[1]):
        raise InvalidRequest(f"{what} is a {cfg.os}/{cfg.architecture} image; dsec runs {'/'.join(PLATFORM)} images")
    rc = cfg.config or _RunConfig()
    env: dict[str, str] = {}
    for item in rc.env or []:
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    env.setdefault("PATH", DEFAULT_PATH)  # as Docker does when an image sets none
    return ImageConfig(
        env=env,
        workdir=posixpath.normpath("/" + rc.working_dir.lstrip("/")) if rc.working_dir else "/",
        user=rc.user or "root",
        entrypoint=rc.entrypoint or None,
        cmd=rc.cmd or None,
        labels=dict(rc.labels or {}),
        exposed_ports=sorted(rc.exposed_ports or {}),
    )


def image_config(data: bytes, what: str) -> ImageConfig:
    """An image config blob (as a layout or a registry holds it) as the version's config: the one mapping
    of env, working directory, user and entrypoint + cmd for imports and pulls alike."""
    return _image_config(_parse(_ConfigFile, data, what), what)


def _diff_ids(cfg: _ConfigFile, count: int, what: str) -> list[str | None]:
    if cfg.rootfs is None:
        return [None] * count  # the blob digests still vouch for every layer
    ids = cfg.rootfs.diff_ids
    if len(ids) != count:
        raise InvalidRequest(f"{what} lists {len(ids)} layer diff_ids for {count} layers")
    for d in ids:
        _blob_name(d, f"{what} diff_id")
    return list(ids)


def _layer(store: Store, blob: str, i: int, media_type: str, diff_id: str | None, digest: str | None) -> LayerSource:
    where = f"{i + 1} ({blob} in {store.label})"
    if LAYER_TYPES.get(media_type) == "zstd":
        check_compression("zstd", where)  # before reading gigabytes we could not use
    h = _hash_blob(store, blob)
    size, compression = h.size, sniff(h.head)
    check_compression(compression, where)
    if digest is None and compression != "none":  # a legacy docker save only has the diff_id, of the tar itself
        h = _hash_blob(store, blob, compression)
    if h.digest != (digest or diff_id):
        kind = "digest" if digest else "diff_id"
        raise InvalidRequest(f"layer {where} does not match its {kind} {digest or diff_id} (got {h.digest})")
    if media_type not in LAYER_TYPES:
        media_type = (
            "application/vnd.oci.image.layer.v1.tar" + {"none": "", "gzip": "+gzip", "zstd": "+zstd"}[compression]
        )
    return LayerSource(digest, diff_id, media_type, size, compression, where, functools.partial(store.open, blob))


def _read_layout(store: Store, reference: str | None) -> OciImage:
    layout = _parse(_Layout, _read_small(store, "oci-layout", "oci-layout"), f"oci-layout in {store.label}")
    if not layout.version.startswith("1."):
        raise InvalidRequest(f"{store.label}: unsupported OCI layout version {layout.version}")
    index = _parse(_Document, _read_small(store, "index.json", "index.json"), f"index.json in {store.label}")
    chosen = _select(index.manifests or [], reference, store.label)
    desc, config_desc, layer_descs = _resolve(store, chosen)
    if config_desc.media_type and config_desc.media_type not in CONFIG_TYPES:
        raise InvalidRequest(f"{desc.digest} is not a container image (config type {config_desc.media_type})")
    what = f"config {config_desc.digest}"
    cfg = _parse(_ConfigFile, _read_blob(store, config_desc, "config"), what)
    config = _image_config(cfg, what)
    layers = []
    for i, (d, diff_id) in enumerate(zip(layer_descs, _diff_ids(cfg, len(layer_descs), what), strict=True)):
        if d.media_type not in LAYER_TYPES:
            raise InvalidRequest(f"layer {i + 1} of {desc.digest} is a {d.media_type!r}, not a filesystem layer")
        name = _blob_name(d.digest, f"layer {i + 1}")
        layer = _layer(store, name, i, d.media_type, diff_id, d.digest)
        if layer.size != d.size:
            raise InvalidRequest(f"layer {layer.where} is {layer.size} bytes, but its descriptor says {d.size}")
        layers.append(layer)
    names = _desc_names(chosen)
    return OciImage(config, layers, names[0] if names else None, desc.digest)


def _read_docker(store: Store, reference: str | None) -> OciImage:
    data = _read_small(store, "manifest.json", "manifest.json")
    try:
        entries = TypeAdapter(list[_DockerEntry]).validate_json(data)
    except ValidationError as e:
        raise InvalidRequest(f"manifest.json in {store.label} is not valid: {validation_message(e)}") from None

    def names(e: _DockerEntry) -> list[str]:
        m = _PATH_DIGEST.fullmatch(norm(e.config))
        return [*(e.repo_tags or []), *([f"sha256:{m[1] or m[2]}"] if m else [])]

    choices = ", ".join(sorted(n for e in entries for n in names(e)[:1])) or "nothing"
    if reference is not None:
        entries = [e for e in entries if _matches(reference, names(e))]
        if not entries:
            raise InvalidRequest(f"no image {reference!r} in {store.label}; it holds: {choices}")
    if len(entries) != 1:
        raise InvalidRequest(f"{store.label} holds several images; choose one with reference=: {choices}")
    entry = entries[0]
    tags = entry.repo_tags or []
    source_ref = next(
        (t for t in tags if reference is not None and _matches(reference, [t])), tags[0] if tags else None
    )

    m = _PATH_DIGEST.fullmatch(norm(entry.config))
    if m is None:
        raise InvalidRequest(f"config {entry.config} in {store.label} is not named by its digest; cannot verify it")
    digest = f"sha256:{m[1] or m[2]}"
    raw = _read_small(store, entry.config, "config")
    _check_digest(hashlib.sha256(raw).hexdigest(), len(raw), digest, None, f"config {entry.config}", store)
    what = f"config {entry.config}"
    cfg = _parse(_ConfigFile, raw, what)
    config = _image_config(cfg, what)
    diff_ids = _diff_ids(cfg, len(entry.layers), what)
    layers = []
    for i, (path, diff_id) in enumerate(zip(entry.layers, diff_ids, strict=True)):
        lm = _PATH_DIGEST.fullmatch(norm(path))
        blob_digest = f"sha256:{lm[1]}" if lm and lm[1] else None
        if blob_digest is None and diff_id is None:
            raise InvalidRequest(f"layer {i + 1} ({path}) in {store.label} has no digest to verify it by")
        layers.append(_layer(store, path, i, "", diff_id, blob_digest))
    return OciImage(config, layers, source_ref, None)


def read_image(source: Path, *, reference: str | None = None) -> OciImage:
    """Read an OCI image layout (directory or tar) or a ``docker save`` archive and choose one image.

    ``reference`` selects by the OCI ``org.opencontainers.image.ref.name`` annotation, Docker's RepoTags
    (``foo`` matches ``docker.io/library/foo:latest``) or digest; it is needed when the source holds
    several images. A multi-platform index yields its linux/amd64 image. Every blob read is checked
    against its sha256 digest; layers are hashed here too, in full."""
    store = _open_source(source)
    if store.has("manifest.json"):  # docker save; Docker 25+ adds an OCI layout, but only this has RepoTags
        return _read_docker(store, reference)
    if store.has("oci-layout"):
        return _read_layout(store, reference)
    raise InvalidRequest(
        f"{source} is neither an OCI image layout (no oci-layout file) nor a docker save archive (no manifest.json)"
    )


def extract_layer(layer: LayerSource, dest: Path) -> ExtractStats:
    """Extract ``layer`` into the empty directory ``dest`` in overlayfs's format (see tar_extract.py).

    The blob's digest and the uncompressed stream's diff_id are checked as it streams; on a mismatch
    (the source changed since :func:`read_image`) this raises InvalidRequest and ``dest`` must be
    discarded, as after any error."""
    label = f"layer {layer.where}"
    check_compression(layer.compression, layer.where)
    try:
        with layer.opener() as raw:
            blob = HashingReader(raw)
            tar_in = HashingReader(decompress(blob, layer.compression))
            stats = extract_tar(tar_in, dest, label=label)
            tar_in.drain()  # the end-of-archive padding belongs to the diff_id too
            blob.drain()
    except DsecError:
        raise
    except READ_ERRORS as e:
        raise read_failure(e, label) from None
    if layer.digest is not None and blob.digest != layer.digest:
        raise InvalidRequest(f"{label} changed since it was read: digest {blob.digest}, expected {layer.digest}")
    if layer.diff_id is not None and tar_in.digest != layer.diff_id:
        raise InvalidRequest(f"{label}: uncompressed content {tar_in.digest} does not match diff_id {layer.diff_id}")
    return stats
