"""A private layer repository seeded from another one by hard links: a bench (or a test) that publishes,
removes or garbage-collects images must not do it in a repository others use, and need not build the
built-in images again either."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from dsec import InvalidRequest

# The repository's keys as docs/images.md documents them (a format every node sharing a repository reads),
# not dsec's helpers; a unit test holds the two to the same keys.
TAG_KEY_PART = 250  # hex characters per path component of a tag's key


def tag_key(name: str) -> str:
    text = name.encode().hex()
    return "tags/" + "/".join(text[i : i + TAG_KEY_PART] for i in range(0, len(text), TAG_KEY_PART)) + ".json"


def image_key(digest: str) -> str:
    return f"images/{digest}.json"


def layer_key(digest: str) -> str:
    return f"layers/{digest}.json"


def trace_key(layer_digest: str) -> str:
    return f"traces/{layer_digest}.json"


def chunk_key(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        # a damaged manifest must not name a path outside chunks/
        raise InvalidRequest(f"not a blake3 digest: {digest!r}")
    return f"chunks/{digest[:2]}/{digest}"


def seed_repository(source: Path, dest: Path, names: Iterable[str]) -> None:
    """Make ``names`` (their tags, versions, lineage, layers, chunks, traces) available in the repository
    ``dest`` by hard links into ``source``: objects are immutable, so the two repositories can share
    them, and nothing done to ``dest`` (a gc, a removal) reaches ``source``. FileNotFoundError for a
    name ``source`` does not hold."""

    def link(key: str) -> bool:
        src, dst = source / key, dest / key
        if not src.exists():
            return False
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)
        return True

    for name in names:
        key = tag_key(name)
        if not link(key):
            raise FileNotFoundError(f"{name} is not in {source}")
        digest: str | None = json.loads((source / key).read_text())["digest"]
        while digest is not None and link(image_key(digest)):
            version = json.loads((source / image_key(digest)).read_text())
            for layer in version["layers"]:
                link(layer_key(layer["digest"]))
                link(trace_key(layer["digest"]))
                for chunk in json.loads((source / layer_key(layer["digest"])).read_text())["chunks"]:
                    link(chunk_key(chunk))
            digest = version.get("parent")
