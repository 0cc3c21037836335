"""Pushing a dsec image to an OCI registry: each layer (a mounted EROFS image) written as a gzip OCI layer
tar (oci_export.py), uploaded unless the repository has it, then the config and an OCI image manifest
under the tag, so ``docker pull`` and ``podman pull`` run what the sandbox had.

Layers are exported one at a time into temporary files under the layer store (a layer of any size is
never held in memory) and removed whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from ..protocol.pull import PushResult
from .model import ImageVersion
from .oci_export import MANIFEST_TYPE, ExportedLayer, config_document, export_layer, manifest_document
from .registry import Reference, RegistryClient
from .registry.push import Pusher

READ_CHUNK = 1 << 20


class Layers(Protocol):
    tmp: Path

    async def mount(self, digest: str) -> Path: ...


def _export_to(root: Path, path: Path) -> ExportedLayer:
    with open(path, "wb") as f:
        return export_layer(root, f)


def _reader(path: Path) -> Callable[[], AsyncIterator[bytes]]:
    """The file's bytes, read afresh each time the request is sent."""

    async def chunks() -> AsyncIterator[bytes]:
        with open(path, "rb") as f:  # noqa: ASYNC230 - each read below goes to a thread
            while block := await asyncio.to_thread(f.read, READ_CHUNK):
                yield block

    return chunks


async def push_version(version: ImageVersion, ref: Reference, layers: Layers, client: RegistryClient) -> PushResult:
    """Push ``version`` to ``ref`` (its tag; ``latest`` without one)."""
    started = time.monotonic()
    pusher = Pusher(client.transport, ref)
    exported: list[ExportedLayer] = []
    uploaded = sent = 0
    for layer in version.layers:
        root = await layers.mount(layer.digest)
        path = layers.tmp / f"push-{secrets.token_hex(8)}.tar.gz"
        try:
            out = await asyncio.to_thread(_export_to, root, path)
            exported.append(out)
            if not await pusher.has_blob(out.digest):
                await pusher.upload_blob(out.digest, out.size, _reader(path))
                uploaded, sent = uploaded + 1, sent + out.size
        finally:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(path.unlink)
    created = version.created_at.isoformat().replace("+00:00", "Z")
    history = [layer.created_by or f"dsec layer {layer.digest[:12]}" for layer in version.layers]
    config = config_document(version.config, [x.diff_id for x in exported], created, history)
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    if not await pusher.has_blob(config_digest):
        await pusher.upload_blob(config_digest, len(config), lambda: config)
        sent += len(config)
    manifest = manifest_document(config, exported)
    digest = await pusher.put_manifest(ref.tag or "latest", manifest, MANIFEST_TYPE)
    return PushResult(
        reference=f"{ref.name}:{ref.tag or 'latest'}@{digest}",
        digest=digest,
        layers=len(exported),
        layers_uploaded=uploaded,
        bytes_uploaded=sent,
        seconds=round(time.monotonic() - started, 3),
    )
