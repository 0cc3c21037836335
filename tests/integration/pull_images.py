"""Layers and stores for the pull tests (test_registry_pull*.py): tars with any kind of member, an image
store whose repository the tests can list, and what "nothing left behind" compares."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import os
import subprocess
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from dsec.images.registry import RegistryOptions, RetryPolicy
from dsec.images.store import ImageStore

from .registry import LAYER_GZIP, LAYER_TAR, Layer

LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2)


@dataclass(frozen=True)
class M:
    """One tar member: a file (``data``), or a directory, symlink, hardlink, device by ``kind``."""

    name: str
    data: bytes = b""
    kind: bytes = tarfile.REGTYPE
    mode: int = 0o644
    link: str = ""


def tar_of(members: list[M]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type, info.mode, info.linkname, info.mtime = m.kind, m.mode, m.link, 1_700_000_000
            if m.kind == tarfile.CHRTYPE:
                info.devmajor, info.devminor = 1, 3
            if m.kind == tarfile.REGTYPE:
                info.size = len(m.data)
                tar.addfile(info, io.BytesIO(m.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def make_layer(tar: bytes, compression: str = "gzip") -> Layer:
    if compression == "gzip":
        return Layer(gzip.compress(tar, mtime=0), tar, LAYER_GZIP)
    if compression == "zstd":
        import zstandard

        return Layer(zstandard.ZstdCompressor().compress(tar), tar, LAYER_ZSTD)
    return Layer(tar, tar, LAYER_TAR)


def files_layer(files: dict[str, bytes], compression: str = "gzip") -> Layer:
    return make_layer(tar_of([M(name, data) for name, data in files.items()]), compression)


def gnu_sparse(name: str, realsize: int) -> bytes:
    """A tar of one GNU sparse member with no data: ``realsize`` bytes of hole in ~1.5 KB."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[483:495] = b"%011o\0" % realsize
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[:512])
    return bytes(header) + bytes(1024)


def new_store(root: Path, repository: Path | None = None, **options: object) -> ImageStore:
    given: dict[str, object] = {"use_docker_config": False, "retry": FAST, **options}
    opts = RegistryOptions(**given)  # type: ignore[arg-type]
    return ImageStore(root, repository or root / "repository", lazy=False, mount=False, registry=opts)


@dataclass(frozen=True)
class Residue:
    """What a store holds: every repository key, and the node's temporary and blob files."""

    keys: frozenset[str]
    tmp: frozenset[str]
    blobs: frozenset[str]


async def residue(store: ImageStore) -> Residue:
    keys = frozenset(await store.catalog.repo.list(""))
    return Residue(keys, frozenset(os.listdir(store.layers.tmp)), frozenset(os.listdir(store.layers.blobs)))


@contextlib.asynccontextmanager
async def mounted(store: ImageStore, digest: str, mnt: Path) -> AsyncIterator[Path]:
    """Layer ``digest`` mounted read-only at ``mnt`` for the ``with`` block: its files as a sandbox sees
    them (fsck.erofs --extract would do without a mount, but loses setuid bits and hardlinks)."""
    blob = await store.layers.fetch_full(digest)
    await asyncio.to_thread(_run, ["mount", "-t", "erofs", "-o", "ro", str(blob), str(mnt)], mnt)
    try:
        yield mnt
    finally:
        await asyncio.to_thread(_run, ["umount", str(mnt)])


def _run(argv: list[str], make: Path | None = None) -> None:
    if make is not None:
        make.mkdir(parents=True)
    subprocess.run(argv, check=True, capture_output=True)


def blob_gets(requests: list[str], digest: str) -> int:
    return sum(1 for r in requests if r.startswith("GET ") and r.endswith(f"/blobs/{digest}"))


def manifest_gets(requests: list[str]) -> int:
    return sum(1 for r in requests if r.startswith("GET ") and "/manifests/" in r)
