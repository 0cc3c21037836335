"""The layer repository's integrity check, over a real local repository damaged in each way it can be."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.images.catalog import Catalog
from dsec.images.chunks import chunk_key
from dsec.images.model import ImageVersion, LayerRef, image_key, layer_key, tag_key
from dsec.images.repository import LocalRepository
from dsec.images.verify import verify
from dsec.protocol.build import LayerRole


@pytest.fixture
async def repo(tmp_path: Path) -> tuple[Catalog, Path, list[str]]:
    root = tmp_path / "repo"
    catalog = Catalog(LocalRepository(root))
    blob = tmp_path / "layer.erofs"
    blob.write_bytes(os.urandom(3 << 20) + b"\0" * (2 << 20))  # several chunks, two of them alike
    manifest, _ = await catalog.publish_layer(blob)
    ref = LayerRef(digest=manifest.digest, role=LayerRole.base, size=manifest.size)
    await catalog.publish(ImageVersion(name="test/a:1", layers=[ref]))
    await catalog.publish(ImageVersion(name="test/b:1", layers=[ref], description="the same layer"))
    return catalog, root, manifest.chunks


async def test_a_whole_repository_passes(repo: tuple[Catalog, Path, list[str]]) -> None:
    catalog, _, chunks = repo
    report = await verify(catalog)
    assert report.ok, report.problems
    assert (report.tags, report.versions, report.layers, report.chunks) == (2, 2, 1, len(set(chunks)))
    assert report.bytes_read == 5 << 20


async def test_a_corrupt_chunk_is_found(repo: tuple[Catalog, Path, list[str]]) -> None:
    catalog, root, chunks = repo
    path = root / chunk_key(chunks[0])
    path.write_bytes(b"x" + path.read_bytes()[1:])
    report = await verify(catalog)
    assert not report.ok and any("corrupt" in p for p in report.problems), report.problems
    assert (await verify(catalog, read_chunks=False)).ok  # presence alone cannot see it


async def test_a_missing_chunk_manifest_or_version_is_found(repo: tuple[Catalog, Path, list[str]]) -> None:
    catalog, root, chunks = repo
    (root / chunk_key(chunks[-1])).unlink()
    assert any("missing" in p or "not found" in p for p in (await verify(catalog, read_chunks=False)).problems)
    digest = (await catalog.tag("test/a:1")).digest  # type: ignore[union-attr]
    version = await catalog.version(digest)
    (root / layer_key(version.layers[0].digest)).unlink()
    (root / image_key(digest)).unlink()
    fresh = Catalog(LocalRepository(root))  # no cached manifests or versions
    problems = (await verify(fresh)).problems
    assert any(p.startswith("tag test/a:1") for p in problems), problems
    assert any(p.startswith("test/b:1 layer") for p in problems), problems


async def test_a_tag_that_is_not_a_tag_is_skipped_not_fatal(repo: tuple[Catalog, Path, list[str]]) -> None:
    catalog, root, _ = repo
    (root / tag_key("test/junk:1")).parent.mkdir(parents=True, exist_ok=True)
    (root / tag_key("test/junk:1")).write_bytes(b"not json")
    assert (await verify(catalog)).tags == 2


def test_the_cli_says_ok_or_names_the_damage(repo: tuple[Catalog, Path, list[str]]) -> None:
    import subprocess
    import sys

    _, root, chunks = repo

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dsec", "image", "verify", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})

    good = run("--repository", str(root))
    assert good.returncode == 0 and "2 tags, 2 versions, 1 layers" in good.stdout and "ok" in good.stdout
    (root / chunk_key(chunks[0])).write_bytes(b"damaged")
    bad = run("--repository", str(root))
    assert bad.returncode == 1 and "corrupt" in bad.stdout, bad.stdout
    missing = run("--repository", str(root / "nope"))
    assert missing.returncode == 2 and "no layer repository" in missing.stderr
