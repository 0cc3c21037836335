"""The image model as stored in the layer repository.

An image version is an ordered list of content-addressed layers (lowest first) plus a config; it is
named by the blake3 digest of its canonical JSON, so a published version can never change. A tag
(``repo:tag``) points at one version. Keys in the repository:

- ``chunks/XX/<blake3>``: chunk bytes (see chunks.py), shared by every layer that holds them;
- ``layers/<digest>.json``: a layer's manifest (its EROFS blob as chunks);
- ``images/<digest>.json``: an image version;
- ``tags/<hex of repo:tag>.json``: which version a name points at (a long name's hex split in 250-character
  directory levels);
- ``traces/<layer digest>.json``: chunk access order recorded on first runs, used to prefetch;
- ``registry/layers/<sha256 hex>-<scrub rules>.json``: the EROFS layer a registry layer became (pull.py).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field

from ..protocol.build import LayerRole

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _now() -> datetime:
    return datetime.now(UTC)


class LayerManifest(BaseModel):
    """A layer: one EROFS image, stored as fixed-size chunks. ``digest`` is blake3 of the whole image."""

    model_config = ConfigDict(extra="forbid")

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    chunk_size: int = Field(gt=0)
    chunks: list[str]
    format: Literal["erofs"] = "erofs"
    created_at: datetime = Field(default_factory=_now)

    @property
    def key(self) -> str:
        return layer_key(self.digest)


class ImageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: dict[str, str] = Field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    workdir: str = "/"
    user: str = "root"
    # as OCI keeps them: a sandbox's command is entrypoint + cmd (versions stored before cmd was kept apart
    # have both in entrypoint)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    exposed_ports: list[str] = Field(default_factory=list)  # "8080/tcp", recorded (sandboxes have no port mapping)


LATER_CONFIG_FIELDS: dict[str, object] = {"cmd": None, "labels": {}, "exposed_ports": []}


class LayerRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: LayerRole
    size: int = Field(ge=0)
    created_by: str = ""  # the build step, "snapshot of sb-…", "import of …"


class ImageSource(BaseModel):
    """Where a pulled version came from: the registry reference and what it resolved to then."""

    model_config = ConfigDict(extra="forbid")

    reference: str  # canonical, as parse_reference prints it
    digest: str  # what the reference resolved to: the index (manifest list) if it was one, else the manifest
    manifest: str  # the platform's image manifest
    platform: str = "linux/amd64"


class ImageVersion(BaseModel):
    """One immutable version of an image."""

    model_config = ConfigDict(extra="forbid")

    name: str  # the repo:tag it was published under
    layers: list[LayerRef]
    config: ImageConfig = Field(default_factory=ImageConfig)
    parent: str | None = None  # digest of the version this one was built on or snapshotted from
    source_sandbox: str | None = None  # the sandbox a snapshot was taken of
    description: str = ""
    scrubbed: list[str] = Field(default_factory=list)  # residue removed before packing (paths)
    created_at: datetime = Field(default_factory=_now)
    # set on versions pulled from a registry. Left out of the canonical form when unset, so the digests of
    # versions from before it existed stay what they were.
    source: ImageSource | None = None

    def canonical(self) -> bytes:
        data = self.model_dump(mode="json")
        if data.get("source") is None:
            data.pop("source", None)
        # the config's later fields likewise, at their defaults: a version stored before they existed
        # keeps its digest
        config = data["config"]
        for key, empty in LATER_CONFIG_FIELDS.items():
            if config.get(key) == empty:
                config.pop(key, None)
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return blake3.blake3(self.canonical()).hexdigest()

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


class CachedStep(BaseModel):
    """What a build step with a given cache key produced (``buildcache/<key>.json``)."""

    model_config = ConfigDict(extra="forbid")

    layer: LayerRef
    scrubbed: list[str] = Field(default_factory=list)


REGISTRY_LAYERS = "registry/layers/"


class RegistryLayer(BaseModel):
    """Which EROFS layer a registry layer became, for every node sharing the repository (pull.py).

    Keyed by the blob's sha256 and the scrub rules it was packed with: a node with other rules must not
    take a layer that still holds what its rules leave out."""

    model_config = ConfigDict(extra="forbid")

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")  # the blob as the registry serves it
    diff_id: str | None = None  # sha256 of its uncompressed tar, from the image config
    size: int = Field(ge=0)  # the blob's
    layer: str = Field(pattern=r"^[0-9a-f]{64}$")  # the EROFS layer
    layer_size: int = Field(ge=0)
    scrub: str  # fingerprint of the scrub rules
    scrubbed: list[str] = Field(default_factory=list)
    created_at: datetime = Field(default_factory=_now)


def registry_layer_key(digest: str, scrub: str) -> str:
    return f"{REGISTRY_LAYERS}{digest.removeprefix('sha256:')}-{scrub}.json"


class Tag(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    # the tenant that published it; absent (public) for built-in images and the operator's, and in
    # repositories from before tenants. Written only when set, so such tags stay byte-identical.
    owner: str | None = None

    def dump(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def layer_key(digest: str) -> str:
    return f"layers/{digest}.json"


def image_key(digest: str) -> str:
    return f"images/{digest}.json"


# hex characters per path component of a tag key: with ".json", within a file name's 255 bytes (NAME_MAX)
TAG_KEY_PART = 250


def tag_key(name: str) -> str:
    # hex: one to one, and nothing an object store could mis-encode. A name too long for one file name
    # (over 125 bytes) continues in subdirectories, so every name the wire accepts has a key, and the
    # keys of shorter names (all names before long ones were allowed) stay what they were.
    text = name.encode().hex()
    parts = [text[i : i + TAG_KEY_PART] for i in range(0, len(text), TAG_KEY_PART)]
    return f"tags/{'/'.join(parts)}.json"


def trace_key(layer_digest: str) -> str:
    return f"traces/{layer_digest}.json"
