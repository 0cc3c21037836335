"""A family of task images for `dsec bench pull`, written as one OCI image layout: K images over the same
base layers, each with a small layer of its own.

The base is meant to look like a real distribution's, not like one big file: many files of mixed sizes
(over a thousand for 300 MB: mostly small, some of a megabyte, a few of tens), part compressible text and
part incompressible bytes (as shared libraries and archives are), a static busybox so that commands run,
and its applets as symlinks. Everything comes from a seeded generator, so the same parameters give the same
bytes and the same digests on every run and every machine (a run can be compared with the next, and the
registry's blobs are known in advance).

Layers are streamed to gzip blobs (no layer is held in memory whole), as ``docker push`` would store them.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import shutil
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
MTIME = 1_700_000_000  # fixed, so that the tars (and their digests) do not depend on when they were made
APPLETS = ("sh", "true", "false", "echo", "cat", "ls", "env", "sleep", "test")
SMALLEST, LARGEST = 128, 1 << 20  # the bulk of the files: log-uniform between these
BIG_EVERY, BIG_RANGE = 200, (8 << 20, 32 << 20)  # one file in BIG_EVERY is large (a model, an archive)
TEXT_POOL = 1 << 20  # the text compressible files are cut from, per layer
FILES_PER_DIR = 50


@dataclass(frozen=True)
class LayerBlob:
    """One layer as the layout stores it."""

    digest: str  # of the gzip blob
    diff_id: str  # of the uncompressed tar
    size: int  # blob bytes (what a registry serves)
    tar_size: int  # uncompressed tar bytes
    files: int
    incompressible_bytes: int  # of the files' contents, those that gzip cannot shrink

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": LAYER_GZIP, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Family:
    """The images of a family, by their name in the layout (``task-00``, ...), and their layers."""

    layout: Path
    base: tuple[LayerBlob, ...]
    tasks: tuple[LayerBlob, ...]  # one per image, in the order of ``names``
    names: tuple[str, ...]
    config_bytes: int  # all images' configs and manifests together

    @property
    def unique_layer_bytes(self) -> int:
        """What a registry has to serve at least once for all the images: each distinct layer once."""
        distinct = {x.digest: x.size for x in (*self.base, *self.tasks)}
        return sum(distinct.values())

    def summary(self) -> dict[str, Any]:
        return {
            "images": len(self.names),
            "base_layers": [layer_summary(x) for x in self.base],
            "task_layer_bytes": [x.size for x in self.tasks],
            "base_bytes": sum(x.size for x in self.base),
            "base_tar_bytes": sum(x.tar_size for x in self.base),
            "unique_layer_bytes": self.unique_layer_bytes,
            "configs_and_manifests_bytes": self.config_bytes,
        }


def layer_summary(layer: LayerBlob) -> dict[str, Any]:
    return {
        "digest": layer.digest,
        "size": layer.size,
        "tar_size": layer.tar_size,
        "files": layer.files,
        "incompressible_bytes": layer.incompressible_bytes,
    }


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _GzipSink:
    """Where a streaming tarfile writes: hashes the tar, gzips it (level 6, as docker does; zlib's gzip
    header carries no time or name, so the blob is reproducible) into ``path``, hashing the blob too."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("wb")
        self.tar_hash, self.blob_hash = hashlib.sha256(), hashlib.sha256()
        self.tar_size = self.size = 0
        self._gzip = zlib.compressobj(6, zlib.DEFLATED, 31)

    def write(self, data: bytes) -> int:
        self.tar_hash.update(data)
        self.tar_size += len(data)
        self._out(self._gzip.compress(data))
        return len(data)

    def _out(self, data: bytes) -> None:
        self.blob_hash.update(data)
        self.size += len(data)
        self.file.write(data)

    def close(self) -> None:
        self._out(self._gzip.flush())
        self.file.close()


def file_sizes(rng: random.Random, total: int) -> Iterator[int]:
    """Sizes adding up to ``total``: mostly log-uniform between SMALLEST and LARGEST, one in BIG_EVERY
    large; the last one is cut to fit."""
    left, i = total, 0
    while left > 0:
        i += 1
        if i % BIG_EVERY == 0:
            size = rng.randint(*BIG_RANGE)
        else:
            size = int(math.exp(rng.uniform(math.log(SMALLEST), math.log(LARGEST))))
        size = min(size, left)
        left -= size
        yield size


def text_pool(rng: random.Random) -> bytes:
    """TEXT_POOL bytes of words from a small vocabulary: compresses about as source code and docs do."""
    letters = "abcdefghijklmnopqrstuvwxyz_"
    vocabulary = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(2000)]
    out: list[str] = []
    length = 0
    while length < TEXT_POOL:
        line = " ".join(rng.choices(vocabulary, k=rng.randint(3, 14))) + "\n"
        out.append(line)
        length += len(line)
    return "".join(out).encode()[:TEXT_POOL]


def text_of(rng: random.Random, pool: bytes, size: int) -> bytes:
    """``size`` bytes cut from ``pool`` at random places (so files differ, and gzip finds no long repeats)."""
    parts: list[bytes] = []
    left = size
    while left > 0:
        n = min(left, rng.randint(512, 64 << 10))
        start = rng.randrange(0, len(pool) - n + 1)
        parts.append(pool[start : start + n])
        left -= n
    return b"".join(parts)


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, size, link, MTIME
    return info


class _LayerWriter:
    """Members of one layer, each directory entered once before what it holds."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.dirs: set[str] = set()
        self.files = 0

    def _parents(self, name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self.dirs:
                self.dirs.add(d)
                self.tar.addfile(_info(d, tarfile.DIRTYPE, 0o755))

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._parents(name)
        self.tar.addfile(_info(name, mode=mode, size=len(data)), io.BytesIO(data))
        self.files += 1

    def symlink(self, name: str, target: str) -> None:
        self._parents(name)
        self.tar.addfile(_info(name, tarfile.SYMTYPE, 0o777, link=target))


def write_layer(
    blobs: Path, seed: str, content_bytes: int, incompressible: float, busybox: Path | None = None, prefix: str = "usr"
) -> LayerBlob:
    """A layer of about ``content_bytes`` of file contents under ``prefix``, ``incompressible`` of them
    (by bytes, roughly) random; with ``busybox``, also /bin/busybox, its applets and a minimal /etc."""
    rng = random.Random(seed)
    pool = text_pool(rng)
    tmp = blobs / f".writing-{hashlib.sha256(seed.encode()).hexdigest()[:16]}"
    sink = _GzipSink(tmp)
    random_bytes = 0
    try:
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            out = _LayerWriter(tar)
            if busybox is not None:
                out.file("bin/busybox", busybox.read_bytes(), 0o755)
                for applet in APPLETS:
                    out.symlink(f"bin/{applet}", "busybox")
                out.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
                out.file("etc/group", b"root:x:0:\n")
            for i, size in enumerate(file_sizes(rng, content_bytes)):
                name = f"{prefix}/d{i // FILES_PER_DIR:04d}/f{i % FILES_PER_DIR:02d}"
                if rng.random() < incompressible:
                    out.file(name + ".so", rng.randbytes(size), 0o755)
                    random_bytes += size
                else:
                    out.file(name + ".txt", text_of(rng, pool, size))
        files = out.files
    finally:
        sink.close()
    digest = "sha256:" + sink.blob_hash.hexdigest()
    tmp.replace(blobs / digest.removeprefix("sha256:"))
    diff_id = "sha256:" + sink.tar_hash.hexdigest()
    return LayerBlob(digest, diff_id, sink.size, sink.tar_size, files, random_bytes)


def base_split(total: int, layers: int) -> list[int]:
    """The base's bytes over its layers, each half the one below it (a distribution, then runtimes, then
    libraries): 4/7, 2/7, 1/7 of the whole for three."""
    weights = [2.0 ** (layers - 1 - i) for i in range(layers)]
    sizes = [int(total * w / sum(weights)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


class Layout:
    """An OCI image layout being written: blobs, and the names index.json gives images."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.blobs = directory / "blobs" / "sha256"
        self.blobs.mkdir(parents=True, exist_ok=True)
        (directory / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.entries: list[dict[str, Any]] = []

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = sha256(data)
        (self.blobs / digest.removeprefix("sha256:")).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(self, name: str, layers: list[LayerBlob]) -> int:
        """An amd64 image over ``layers`` named ``name``; returns its config's and manifest's bytes."""
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin:/usr/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [x.diff_id for x in layers]},
        }
        config_desc = self.blob(json.dumps(config, sort_keys=True).encode(), OCI_CONFIG)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config_desc,
            "layers": [x.descriptor() for x in layers],
        }
        desc = self.blob(json.dumps(manifest, sort_keys=True).encode(), OCI_MANIFEST)
        self.entries.append({**desc, "annotations": {REF_ANNOTATION: name}})
        index = {"schemaVersion": 2, "manifests": self.entries}
        (self.directory / "index.json").write_text(json.dumps(index, sort_keys=True))
        return int(config_desc["size"]) + int(desc["size"])


def task_name(i: int) -> str:
    return f"task-{i:02d}"


def write_family(
    directory: Path,
    *,
    k: int,
    base_bytes: int,
    base_layers: int,
    task_bytes: int,
    incompressible: float,
    busybox: Path,
    seed: str = "dsec-bench-pull",
) -> Family:
    """K images in a fresh layout at ``directory``: the same base layers (busybox in the first), then one
    small layer of the image's own."""
    if directory.exists():
        shutil.rmtree(directory)
    layout = Layout(directory)
    base = tuple(
        write_layer(layout.blobs, f"{seed}/base/{i}", size, incompressible, busybox if i == 0 else None, f"usr/b{i}")
        for i, size in enumerate(base_split(base_bytes, base_layers))
    )
    tasks: list[LayerBlob] = []
    names: list[str] = []
    config_bytes = 0
    for i in range(k):
        name = task_name(i)
        task = write_layer(layout.blobs, f"{seed}/task/{i}", task_bytes, incompressible, prefix=f"task/{name}")
        config_bytes += layout.image(name, [*base, task])
        tasks.append(task)
        names.append(name)
    return Family(directory, base, tuple(tasks), tuple(names), config_bytes)
