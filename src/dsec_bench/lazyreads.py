"""`dsec bench lazy-reads`: a whole layer read with the page cache dropped, through its lazy mount and
through a local EROFS mount of the same image, alternately.

No daemon: the bench packs a layer (big and small files of random bytes), publishes it as 1 MiB chunks in
a local repository, and wires a node's image side as the daemon does (the fetcher writing complete layers
into the node's ``blobs/``, NodeLayers mounting them). The layer is mounted lazily and read once whole,
which fetches every chunk; the fetcher then writes the layer's local file and the mount switches to it.
Then, for each round, with ``drop_caches`` before every read and the order rotated each round, the whole
tree is read through

- ``lazy``: the node's mount of the layer, as a sandbox created now gets it;
- ``local``: an EROFS mount of a separate copy of the image file;
- ``fuse``: an EROFS mount of the fetcher's FUSE file of the layer (what lazy reads cost before the
  switch, and what sandboxes created before it still read);
- ``local_again``: a second mount of the same local image, the control: its ratio to ``local`` is what
  the machine's noise alone makes of two identical paths.

The ratios reported are medians over rounds of path/local within a round: a machine shared with other
work slows neighbouring reads alike, not a whole column.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from dsec.images.catalog import Catalog
from dsec.images.chunks import DEFAULT_CHUNK, ChunkStore
from dsec.images.layers import NodeLayers
from dsec.images.lazy import Fetcher, mount_layer, unmount_layer
from dsec.images.model import LayerManifest, layer_key
from dsec.images.repository import LocalRepository, open_repository
from dsec.isolation.mounts import unmount_under

from .common import Json, host_facts, write_json
from .images import drop_caches, read_tree

PATHS = ("lazy", "local", "fuse", "local_again")
TARGET = 0.9  # issue 23: cold lazy reads >= 0.9x a local EROFS mount
BIG_SHARE = 0.7  # of the layer's bytes in 4 MiB files; the rest in files of 1 to 64 KiB


def make_tree(src: Path, total_bytes: int, seed: int = 23) -> int:
    """Files of random bytes adding up to ``total_bytes``; returns how many files."""
    rng = random.Random(seed)
    big, small = src / "big", src / "small"
    big.mkdir(parents=True)
    small.mkdir()
    files, left = 0, int(total_bytes * BIG_SHARE)
    while left > 0:
        size = min(left, 4 << 20)
        (big / f"f{files:05}").write_bytes(rng.randbytes(size))
        files, left = files + 1, left - size
    left = total_bytes - int(total_bytes * BIG_SHARE)
    while left > 0:
        size = min(left, rng.randint(1 << 10, 64 << 10))
        sub = small / f"d{files // 200:04}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{files:06}").write_bytes(rng.randbytes(size))
        files, left = files + 1, left - size
    return files


async def publish(image: Path, repo: Path) -> LayerManifest:
    store = ChunkStore(LocalRepository(repo))
    whole, m, _ = await store.put_file(image, DEFAULT_CHUNK)
    manifest = LayerManifest(digest=whole, size=m.size, chunk_size=m.chunk_size, chunks=m.chunks)
    await LocalRepository(repo).put(layer_key(whole), manifest.model_dump_json().encode())
    return manifest


def summarize_rounds(rounds: Sequence[dict[str, float]]) -> Json:
    """MB/s per path (median, min, max over rounds) and the ratios to ``local``: the median of the
    per-round ratios, and the ratio of the medians."""
    paths = [p for p in PATHS if all(p in r for r in rounds)]
    mb_s = {
        p: {
            k: round(f([r[p] for r in rounds]), 1)
            for k, f in (("median", statistics.median), ("min", min), ("max", max))
        }
        for p in paths
    }
    ratios: Json = {}
    for p in paths:
        if p == "local":
            continue
        per_round = [r[p] / r["local"] for r in rounds]
        ratios[f"{p}_over_local"] = round(statistics.median(per_round), 3)
        ratios[f"{p}_over_local_per_round"] = [round(x, 3) for x in per_round]
        ratios[f"{p}_over_local_of_medians"] = round(mb_s[p]["median"] / mb_s["local"]["median"], 3)
    return {"rounds": len(rounds), "mb_s": mb_s, "ratios": ratios}


def verdict(summary: Json) -> Json:
    ratio = summary["ratios"].get("lazy_over_local")
    return {f"cold lazy reads >= {TARGET}x local EROFS": ratio is not None and ratio >= TARGET}


async def measure(console: Console, work: Path, mb: int, rounds: int) -> Json:
    src, image, repo, node = work / "src", work / "layer.erofs", work / "repo", work / "node"
    t = time.perf_counter()
    files = await asyncio.to_thread(make_tree, src, mb * 10**6)
    argv = ["mkfs.erofs", "--quiet", "-T0", "--all-root", str(image), str(src)]
    await asyncio.to_thread(subprocess.run, argv, check=True)
    manifest = await publish(image, repo)
    console.print(f"layer: {files} files, {manifest.size / 1e6:.0f} MB image, packed in {time.perf_counter() - t:.1f}s")
    await asyncio.to_thread(shutil.rmtree, src)

    fetcher = Fetcher(node / "fetcher", str(repo), 2 * manifest.size + (64 << 20), complete_dir=node / "blobs")
    layers = NodeLayers(node, Catalog(open_repository(str(repo))), fetcher)
    await fetcher.start()
    try:
        await layers.start(fetcher_restarted=False)
        lazy = await layers.mount(manifest.digest)
        drop_caches()
        size, fill_s = await asyncio.to_thread(read_tree, lazy)  # every chunk fetched from the repository
        t = time.perf_counter()
        while not (node / "blobs" / manifest.digest).exists():
            if time.perf_counter() - t > 120:
                raise RuntimeError("the fetcher wrote no complete file of the layer within 120 s")
            await asyncio.sleep(0.1)
        complete_s = time.perf_counter() - t
        t = time.perf_counter()
        switched = await layers.switch_all()
        switch_s = time.perf_counter() - t
        if switched != [manifest.digest]:
            raise RuntimeError(f"the lazy mount did not switch to the local file: {switched}")
        cache = await fetcher.cache_stats()
        mounts = {"lazy": lazy, "local": work / "local", "fuse": work / "fuse", "local_again": work / "again"}
        for name, source in (("local", image), ("fuse", fetcher.path(manifest.digest)), ("local_again", image)):
            mounts[name].mkdir()
            mount_layer(source, mounts[name])
        per_round = []
        for i in range(rounds):
            order = PATHS[i % len(PATHS) :] + PATHS[: i % len(PATHS)]
            rates = {}
            for name in order:
                drop_caches()
                read, seconds = await asyncio.to_thread(read_tree, mounts[name])
                if read != size:
                    raise RuntimeError(f"{name} read {read} bytes, the layer holds {size}")
                rates[name] = read / seconds / 1e6
            console.print(f"round {i + 1}: " + ", ".join(f"{p} {rates[p]:.0f} MB/s" for p in PATHS))
            per_round.append(rates)
        for name in ("local", "fuse", "local_again"):
            unmount_layer(mounts[name], lazy=True)
    finally:
        await layers.detach_all()
        await fetcher.stop()
    return {
        "layer": {"image_bytes": manifest.size, "file_bytes": size, "files": files, "chunk_size": DEFAULT_CHUNK},
        "fill": {
            "read_s": round(fill_s, 3),
            "complete_file_after_s": round(complete_s, 3),
            "switch_s": round(switch_s, 4),
        },
        "disk_after_fill": {"chunk_cache_bytes": cache["bytes"], "complete_file_bytes": manifest.size},
        "per_round_mb_s": [{k: round(v, 1) for k, v in r.items()} for r in per_round],
        **summarize_rounds(per_round),
    }


def main(mb: int, rounds: int, json_out: Path, state_dir: Path) -> int:
    console = Console()
    work = state_dir.resolve()
    if work.exists():
        unmount_under(work)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        result = asyncio.run(measure(console, work, mb, rounds))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        console.print(f"[red]lazy-reads bench failed[/red]: {e}")
        return 1
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "bench": "lazy-reads",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host_facts(),
        "params": {"mb": mb, "rounds": rounds, "page_cache": "dropped before every read (drop_caches=3)"},
        **result,
        "targets": verdict(result),
    }
    write_json(json_out.parent, json_out.name, out)
    console.print_json(data={"mb_s": out["mb_s"], "ratios": out["ratios"], "targets": out["targets"]})
    return 0
