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


async def test_a_mount_found_across_a_fetcher_replacement_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos fetcher case's finding: a mount() under way while a replaced fetcher's mounts were
    detached recorded its (detached) mount as current, and every later sandbox got an empty layer."""
    store = ImageStore(tmp_path, lazy=False, mount=False)
    layers = NodeLayers(tmp_path / "node", store.catalog, None)
    (layers.blobs / "d1").write_bytes(b"erofs")
    mounted: set[Path] = set()
    made: list[Path] = []
    unmounted: list[Path] = []

    def mount_layer(blob: Path, target: Path) -> str:
        made.append(target)
        mounted.add(target)
        if len(made) == 1:
            layers.generation += 1  # start(fetcher_restarted=True), running while this mount was made
        return "file"

    def umount(target: Path, lazy: bool = False) -> None:
        unmounted.append(target)
        mounted.discard(target)

    monkeypatch.setattr("dsec.images.layers.mount_layer", mount_layer)
    monkeypatch.setattr("dsec.images.layers.is_mountpoint", lambda p: p in mounted)
    monkeypatch.setattr("dsec.images.layers.umount", umount)
    target = await layers.mount("d1")
    assert made == [target, target] and unmounted == [target] and target in mounted
    assert await layers.mount("d1") == target and len(made) == 2  # current now: found, not made again
