"""What a node keeps per layer and per image version does not outlive the gc (the soak's finding: a node
that packs snapshots and gcs them grew a lock per layer and a digest per version without end)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsec.images.layers import NodeLayers
from dsec.images.store import ImageStore


@pytest.mark.skipif(os.geteuid() != 0, reason="umount(2) of a directory that is no mount point needs root")
async def test_the_gc_forgets_the_locks_of_the_layers_it_unmounts(tmp_path: Path) -> None:
    store = ImageStore(tmp_path, lazy=False, mount=False)
    layers = NodeLayers(tmp_path / "node", store.catalog, None)
    for digest in ("kept", "dropped", "busy"):
        (layers.mnt / digest).mkdir()
        layers._locks[digest] = asyncio.Lock()
    busy = layers._locks["busy"]
    await busy.acquire()  # a mount of this layer under way: its lock must stay the one lock
    try:
        assert await layers.unmount_unused({"kept"}) == 2
    finally:
        busy.release()
    assert set(layers._locks) == {"kept", "busy"} and layers._locks["busy"] is busy
    assert sorted(p.name for p in layers.mnt.iterdir()) == ["kept"]


async def test_the_gc_forgets_which_versions_had_their_traces_saved(tmp_path: Path) -> None:
    store = ImageStore(tmp_path, lazy=False, mount=False)
    store._traced.update(f"{i:064x}" for i in range(100))
    await store.gc(set())
    assert store._traced == set()
