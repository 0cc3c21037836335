"""Fuzzing the layer repository's documents (images/model.py) as they are read back: layer manifests,
image versions, tags and build-cache entries, by the catalog (images/catalog.py) and by the layer
fetcher that serves them over FUSE (images/fetcher.py). The repository is shared storage another node
may have written, or a damaged disk: a malformed document is the catalog's BackendError (or
ImageNotFound, or no cache hit), and an EIO for the FUSE reader; never another exception, and a read
never returns more than asked or bytes the manifest does not cover."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import blake3
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import BackendError, ImageNotFound
from dsec.images.cache import ChunkCache
from dsec.images.catalog import Catalog
from dsec.images.chunks import ChunkStore, chunk_key
from dsec.images.fetcher import Layers
from dsec.images.model import image_key, layer_key, tag_key
from dsec.images.repository import LocalRepository

from .budget import fuzz, outcome
from .fsguard import fuzz_root
from .jsonmut import JSON_MUTATIONS, mutate_json

CHUNK = 4
DATA = b"0123456789"  # the layer's content: three chunks of 4, 4 and 2 bytes
CHUNKS = [blake3.blake3(DATA[i : i + CHUNK]).hexdigest() for i in range(0, len(DATA), CHUNK)]
LAYER = blake3.blake3(DATA).hexdigest()
LAYER_DOC = {"digest": LAYER, "size": len(DATA), "chunk_size": CHUNK, "chunks": CHUNKS, "format": "erofs"}
REF = {"digest": LAYER, "role": "base", "size": len(DATA), "created_by": ""}
VERSION_DOC = {"name": "fuzz:1", "layers": [REF], "config": {"env": {"PATH": "/bin"}, "workdir": "/", "user": "root"}}
TAG_DOC = {"name": "fuzz:1", "digest": "a" * 64, "owner": "t"}
DOCUMENTS = st.one_of(
    st.tuples(st.just("layer"), st.lists(JSON_MUTATIONS, max_size=3).map(lambda m: _apply(LAYER_DOC, m))),
    st.tuples(st.just("version"), st.lists(JSON_MUTATIONS, max_size=3).map(lambda m: _apply(VERSION_DOC, m))),
    st.tuples(st.just("tag"), st.lists(JSON_MUTATIONS, max_size=2).map(lambda m: _apply(TAG_DOC, m))),
    st.tuples(st.just("cache"), st.lists(JSON_MUTATIONS, max_size=3).map(lambda m: _apply({"layer": REF}, m))),
    st.tuples(st.sampled_from(["layer", "version", "tag", "cache"]), st.binary(max_size=64)),
)


def _apply(doc: dict[str, Any], mutations: list[tuple[list[int], str, str, Any]]) -> bytes:
    value: Any = doc
    for where, what, key, new in mutations:
        value = mutate_json(value, where, what, key, new)
    return json.dumps(value).encode()


async def _catalog(repo: LocalRepository, kind: str) -> None:
    catalog = Catalog(repo)
    try:
        if kind == "layer":
            await catalog.layer(LAYER)
        elif kind == "version":
            await catalog.history("fuzz:1")  # the tag, then the version it names
        elif kind == "tag":
            await catalog.tag("fuzz:1")
            await catalog.tags()
        else:
            await catalog.cached_step("step")
        outcome(f"catalog {kind}: read")
    except (BackendError, ImageNotFound) as e:
        outcome(f"catalog {kind}: {type(e).__name__}")


async def _fetcher(root: Path, repo: LocalRepository, offset: int, size: int) -> None:
    cache = ChunkCache(root / "cache", ChunkStore(repo), 1 << 20, fetch_timeout=5)
    layers = Layers(root / "fetcher", repo, cache, timeout=5)
    try:
        try:
            found = await layers.lookup(LAYER)
            data = await layers.read(LAYER, offset, size)
        except OSError as e:
            outcome(f"fetcher: errno {e.errno}")
            return
        outcome(f"fetcher: read {len(data)} bytes")
        assert found is not None and found >= 0
        assert data == DATA[offset : offset + size]  # what the chunks hold: those are named by their digests
    finally:
        await layers.close()
        cache.close()


@fuzz(300)
@given(doc=DOCUMENTS, offset=st.integers(0, 16), size=st.integers(0, 16))
def test_a_repository_document_is_read_or_refused(doc: tuple[str, bytes], offset: int, size: int) -> None:
    kind, body = doc
    with fuzz_root() as (top, _):
        repo = LocalRepository(top / "repo")
        for i, d in enumerate(CHUNKS):
            asyncio.run(repo.put(chunk_key(d), DATA[i * CHUNK : (i + 1) * CHUNK]))
        asyncio.run(repo.put(layer_key(LAYER), body if kind == "layer" else json.dumps(LAYER_DOC).encode()))
        if kind == "version":
            version_digest = "a" * 64  # never the digest of what is stored: the catalog must say so
            asyncio.run(repo.put(image_key(version_digest), body))
            asyncio.run(repo.put(tag_key("fuzz:1"), json.dumps({"name": "fuzz:1", "digest": version_digest}).encode()))
        elif kind == "tag":
            asyncio.run(repo.put(tag_key("fuzz:1"), body))
        elif kind == "cache":
            asyncio.run(repo.put("buildcache/step.json", body))
        asyncio.run(_catalog(repo, kind))
        if kind == "layer":
            asyncio.run(_fetcher(top, repo, offset, size))
