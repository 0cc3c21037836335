"""The layer repository's integrity check (``dsec image verify``): every tag names a stored version,
every version's layers have manifests, every chunk a manifest lists is present and hashes to its name,
and every layer's chunks together hash to the layer's digest.

After a crash (a node killed mid-publish, a full disk) this tells whether what the repository serves is
whole. Objects that nothing references (a publish that never got its tag) are counted, not errors: gc
removes them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import blake3

from ..errors import DsecError
from .catalog import Catalog
from .chunks import chunk_key
from .model import LayerManifest

MAX_PROBLEMS = 100  # reported in full; the count goes on


@dataclass
class VerifyReport:
    tags: int = 0
    versions: int = 0
    layers: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    @property
    def ok(self) -> bool:
        return self.problem_count == 0

    def problem(self, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)


async def verify(catalog: Catalog, *, read_chunks: bool = True, window: int = 8) -> VerifyReport:
    """Walk tags → versions → layers → chunks. ``read_chunks`` False: check presence only (fast; a
    corrupt chunk goes unseen). Chunks are read ``window`` at a time and not kept: memory stays bounded
    whatever the repository's size."""
    report = VerifyReport()
    layers: dict[str, LayerManifest] = {}
    versions: set[str] = set()
    for tag in await catalog.tags():
        report.tags += 1
        try:
            version = await catalog.version(tag.digest)
        except DsecError as e:
            report.problem(f"tag {tag.name}: {e.message}")
            continue
        if tag.digest in versions:
            continue
        versions.add(tag.digest)
        for ref in version.layers:
            if ref.digest in layers:
                continue
            try:
                layers[ref.digest] = await catalog.layer(ref.digest)
            except DsecError as e:
                report.problem(f"{tag.name} layer {ref.digest[:12]}: {e.message}")
    report.versions, report.layers = len(versions), len(layers)
    chunks: set[str] = set()
    for manifest in layers.values():
        chunks.update(manifest.chunks)
        await _layer(catalog, manifest, report, read_chunks, window)
    report.chunks = len(chunks)
    return report


async def _layer(catalog: Catalog, manifest: LayerManifest, report: VerifyReport, read: bool, window: int) -> None:
    async def one(d: str) -> bytes | None:
        try:
            if read:
                return await catalog.chunks.get_chunk(d)
            if await catalog.repo.exists(chunk_key(d)):
                return b""
            report.problem(f"layer {manifest.digest[:12]}: chunk {d} is missing")
        except DsecError as e:
            report.problem(f"layer {manifest.digest[:12]}: chunk {d}: {e.message}")
        return None

    whole = blake3.blake3()
    whole_ok = True
    for start in range(0, len(manifest.chunks), window):
        for data in await asyncio.gather(*(one(d) for d in manifest.chunks[start : start + window])):
            if data is None:
                whole_ok = False
            else:
                whole.update(data)
                report.bytes_read += len(data)
    if read and whole_ok and whole.hexdigest() != manifest.digest:
        report.problem(f"layer {manifest.digest}: its chunks hash to {whole.hexdigest()}")
