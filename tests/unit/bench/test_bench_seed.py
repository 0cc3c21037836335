"""The seed's repository keys, written from docs/images.md, are the keys dsec's image store uses; and a
seeded repository holds a name's whole lineage, by hard links."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsec import InvalidRequest
from dsec.images.chunks import chunk_key
from dsec.images.model import image_key, layer_key, tag_key, trace_key
from dsec_bench import seed

DIGEST = "0123456789abcdef" * 4


@pytest.mark.parametrize("name", ["dsec/busybox:latest", "a:b", "x" * 125 + ":t", "org/" + "n" * 300 + ":v1"])
def test_a_tags_key_is_the_stores(name: str) -> None:
    assert seed.tag_key(name) == tag_key(name)


def test_the_object_keys_are_the_stores() -> None:
    assert seed.image_key(DIGEST) == image_key(DIGEST)
    assert seed.layer_key(DIGEST) == layer_key(DIGEST)
    assert seed.trace_key(DIGEST) == trace_key(DIGEST)
    assert seed.chunk_key(DIGEST) == chunk_key(DIGEST)


@pytest.mark.parametrize("bad", ["../../etc/passwd", DIGEST.upper(), DIGEST[:-1]])
def test_a_chunk_that_is_no_digest_is_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        seed.chunk_key(bad)


def _put(root: Path, key: str, body: object) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))


def test_a_name_is_seeded_with_its_lineage_by_hard_links(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "dest"
    base, child, layer, chunk = "a" * 64, "b" * 64, "c" * 64, "d" * 64
    _put(source, tag_key("dsec/x:1"), {"digest": child})
    _put(source, image_key(child), {"layers": [{"digest": layer}], "parent": base})
    _put(source, image_key(base), {"layers": [{"digest": layer}], "parent": None})
    _put(source, layer_key(layer), {"chunks": [chunk]})
    _put(source, chunk_key(chunk), "chunk bytes")
    seed.seed_repository(source, dest, ["dsec/x:1"])
    for key in (tag_key("dsec/x:1"), image_key(child), image_key(base), layer_key(layer), chunk_key(chunk)):
        assert os.path.samefile(source / key, dest / key), key
    with pytest.raises(FileNotFoundError):
        seed.seed_repository(source, dest, ["dsec/missing:1"])
