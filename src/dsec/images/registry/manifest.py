"""The documents a registry serves for an image: manifests, indexes (manifest lists) and image configs.

Docker's schema 2 and OCI's formats are read into one set of models; an index is narrowed to one platform's
manifest here (:func:`select_platform`). Schema 1 manifests (signed, deprecated since 2017) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import InvalidRequest, RegistryError, validation_message

__all__ = [
    "ACCEPT",
    "INDEX_TYPES",
    "LINUX_AMD64",
    "MANIFEST_TYPES",
    "MAX_DOCUMENT",
    "Descriptor",
    "ImageConfigFile",
    "ImageIndex",
    "ImageManifest",
    "Platform",
    "parse_config",
    "parse_document",
    "select_platform",
]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
# every type a pull can use, so a registry that negotiates by Accept never falls back to schema 1
ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
# Distribution refuses manifests over 4 MiB; configs of real images are tens of KiB
MAX_DOCUMENT = 4 << 20


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class Platform(_Doc):
    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``os/arch[/variant]``, as ``docker pull --platform`` takes it."""
        parts = text.split("/")
        if not 2 <= len(parts) <= 3 or not all(parts):
            raise InvalidRequest(f"invalid platform {text!r}: expected os/architecture[/variant], e.g. linux/amd64")
        return cls(os=parts[0], architecture=parts[1], variant=parts[2] if len(parts) == 3 else "")

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


LINUX_AMD64 = Platform(os="linux", architecture="amd64")  # what dsec's sandboxes run


class Descriptor(_Doc):
    """A pointer to content by digest: a manifest in an index, a config or a layer in a manifest."""

    media_type: str = Field("", alias="mediaType")
    digest: str
    size: int = Field(ge=0)
    urls: list[str] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)
    platform: Platform | None = None


class ImageManifest(_Doc):
    schema_version: int = Field(2, alias="schemaVersion")
    media_type: str = Field("", alias="mediaType")
    config: Descriptor
    layers: list[Descriptor] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)


class ImageIndex(_Doc):
    schema_version: int = Field(2, alias="schemaVersion")
    media_type: str = Field("", alias="mediaType")
    manifests: list[Descriptor]
    annotations: dict[str, str] = Field(default_factory=dict)


class RunConfig(_Doc):
    env: list[str] | None = Field(None, alias="Env")
    entrypoint: list[str] | None = Field(None, alias="Entrypoint")
    cmd: list[str] | None = Field(None, alias="Cmd")
    working_dir: str | None = Field(None, alias="WorkingDir")
    user: str | None = Field(None, alias="User")


class RootFs(_Doc):
    type: str = ""
    diff_ids: list[str] = Field(default_factory=list)


class ImageConfigFile(_Doc):
    """The parts of an image's config blob a sandbox needs: its platform, run settings and layer diff ids."""

    os: str = ""
    architecture: str = ""
    variant: str = ""
    config: RunConfig | None = None
    rootfs: RootFs | None = None


@dataclass(frozen=True)
class Document:
    """A manifest or an index as served, with the media type it was taken to be."""

    media_type: str
    manifest: ImageManifest | None = None
    index: ImageIndex | None = None


def parse_document(data: bytes, content_type: str, where: str) -> Document:
    """Read a manifest or an index; ``content_type`` is the registry's Content-Type (parameters allowed)."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RegistryError(f"{where} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise RegistryError(f"{where} is not a JSON object")
    served = content_type.split(";", 1)[0].strip().lower()
    # the document's own mediaType is what its digest vouches for; the header is the fallback
    declared = raw.get("mediaType") if isinstance(raw.get("mediaType"), str) else ""
    media = declared or (served if served in INDEX_TYPES | MANIFEST_TYPES else "")
    if not media:  # neither says: the shape does (both fields are required in their documents)
        media = OCI_INDEX if "manifests" in raw else OCI_MANIFEST if "config" in raw else ""
    if media in _SCHEMA1 or raw.get("schemaVersion") == 1 or served in _SCHEMA1:
        raise RegistryError(f"{where} is a Docker schema 1 manifest, which is deprecated and not supported")
    if raw.get("schemaVersion") != 2:
        raise RegistryError(f"{where} has schemaVersion {raw.get('schemaVersion')!r}, expected 2")
    try:
        if media in INDEX_TYPES:
            return Document(media, index=ImageIndex.model_validate(raw))
        if media in MANIFEST_TYPES:
            return Document(media, manifest=ImageManifest.model_validate(raw))
    except ValidationError as e:
        raise RegistryError(f"{where} is not a valid {media}: {validation_message(e)}") from None
    raise RegistryError(f"{where} is a {media or served or 'document'!r}, not an image manifest or index")


def parse_config(data: bytes, where: str) -> ImageConfigFile:
    try:
        return ImageConfigFile.model_validate_json(data)
    except ValidationError as e:
        raise RegistryError(f"{where} is not a valid image config: {validation_message(e)}") from None


def _is_attestation(d: Descriptor) -> bool:
    # BuildKit adds provenance and SBOM documents to an index as "unknown/unknown" manifests
    return d.annotations.get("vnd.docker.reference.type") == "attestation-manifest" or (
        d.platform is not None and d.platform.os == "unknown"
    )


def _variant_rank(want: Platform, got: Platform) -> tuple[int, int, str] | None:
    """How well ``got`` serves ``want`` (lower is better), or None if it cannot."""
    if (got.os, got.architecture) != (want.os, want.architecture):
        return None
    if want.variant:
        # arm64 images rarely write their (only) variant, v8
        implied = {"arm64": "v8"}.get(got.architecture, "")
        return (0, 0, "") if (got.variant or implied) == want.variant else None
    # no variant asked: the baseline first, since an amd64 "v3" image needs a newer CPU than the baseline,
    # then the lowest variant (v2 before v10)
    return (0, 0, "") if not got.variant else (1, len(got.variant), got.variant)


def select_platform(index: ImageIndex, want: Platform, where: str) -> Descriptor:
    """The manifest of ``index`` for ``want``; InvalidRequest listing the platforms there are otherwise."""
    usable = [d for d in index.manifests if not _is_attestation(d)]
    ranked = []
    for d in usable:
        rank = _variant_rank(want, d.platform) if d.platform is not None else None
        if rank is not None:
            ranked.append((rank, d))
    if ranked:
        return min(ranked, key=lambda pair: pair[0])[1]
    found = ", ".join(str(d.platform) if d.platform else "unspecified" for d in usable) or "none"
    raise InvalidRequest(f"{where} has no {want} image (platforms: {found})")
