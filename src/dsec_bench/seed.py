"""A private layer repository seeded from another one by hard links: a bench (or a test) that publishes,
removes or garbage-collects images must not do it in a repository others use, and need not build the
built-in images again either."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from dsec.images.chunks import chunk_key
from dsec.images.model import image_key, layer_key, tag_key, trace_key


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
