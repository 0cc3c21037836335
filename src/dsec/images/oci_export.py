"""A dsec layer (a mounted EROFS image, overlayfs's format) written as an OCI layer: a tar in which a
deletion is a ``.wh.NAME`` file and an opaque directory holds ``.wh..wh..opq`` (the reverse of
tar_extract.py), with owners, modes, times, hard links and extended attributes kept.

The tar goes through gzip as it is written; both digests come out of the same pass (the blob's, of
the compressed bytes, and the diff_id, of the tar), so a layer of any size is read once and held
nowhere in memory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import BackendError
from .model import ImageConfig
from .tar_extract import OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX

SKIPPED_XATTRS = ("trusted.overlay.",)  # overlayfs's own marks: said by whiteout files instead


@dataclass(frozen=True)
class ExportedLayer:
    digest: str  # sha256:... of the gzip blob
    diff_id: str  # sha256:... of the tar
    size: int  # bytes of the blob


class _Hashing:
    """A writable file that hashes and counts what passes through to ``sink``."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.sink.write(data)

    def flush(self) -> None:
        self.sink.flush()


def _xattrs(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name.startswith(SKIPPED_XATTRS):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        # PAX keeps text; a binary value (security.capability) is carried byte for byte as latin-1
        out["SCHILY.xattr." + name] = value.decode("latin-1")
    return out


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


class _Writer:
    def __init__(self, root: Path, tar: tarfile.TarFile) -> None:
        self.root = root
        self.tar = tar
        self.links: dict[tuple[int, int], str] = {}

    def entry(self, rel: str, st: os.stat_result) -> None:
        full = os.path.join(self.root, rel)
        name = os.path.basename(rel)
        parent = os.path.dirname(rel)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            info = tarfile.TarInfo(os.path.join(parent, WHITEOUT_PREFIX + name))
            info.mtime = int(st.st_mtime)
            self.tar.addfile(info)
            return
        info = tarfile.TarInfo(rel)
        info.mode, info.uid, info.gid, info.mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)
        info.pax_headers = _xattrs(full)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            self.tar.addfile(info)
            if _opaque(full):
                marker = tarfile.TarInfo(os.path.join(rel, OPAQUE_MARKER))
                marker.mtime = info.mtime
                self.tar.addfile(marker)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(full)
            self.tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in self.links:
                info.type, info.linkname = tarfile.LNKTYPE, self.links[key]
                self.tar.addfile(info)
                return
            self.links[key] = rel
            info.size = st.st_size
            with open(full, "rb") as f:
                self.tar.addfile(info, f)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
            self.tar.addfile(info)
        else:
            raise BackendError(f"cannot export /{rel}: a device or socket in a layer")

    def walk(self) -> None:
        stack = [""]
        while stack:
            rel = stack.pop()
            with os.scandir(self.root / rel if rel else self.root) as it:
                names = sorted(e.name for e in it)
            for name in names:
                child = f"{rel}/{name}" if rel else name
                st = os.lstat(self.root / child)
                self.entry(child, st)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(child)


def export_layer(root: Path, out: BinaryIO, level: int = 6) -> ExportedLayer:
    """Write the layer mounted at ``root`` to ``out`` as a gzip-compressed OCI layer."""
    blob = _Hashing(out)
    with gzip.GzipFile(fileobj=blob, mode="wb", compresslevel=level, mtime=0) as gz:
        plain = _Hashing(gz)  # type: ignore[arg-type]
        with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            _Writer(root, tar).walk()
    return ExportedLayer(
        digest="sha256:" + blob.hash.hexdigest(), diff_id="sha256:" + plain.hash.hexdigest(), size=blob.size
    )


MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def config_document(config: ImageConfig, diff_ids: list[str], created: str, history: list[str]) -> bytes:
    """The OCI image config of a version: what runs (env, directory, user, entrypoint, cmd), labels,
    exposed ports, and the layers' diff_ids with a history line each."""
    run: dict[str, object] = {
        "Env": [f"{k}={v}" for k, v in config.env.items()],
        "WorkingDir": config.workdir,
        "User": config.user,
    }
    if config.entrypoint is not None:
        run["Entrypoint"] = config.entrypoint
    if config.cmd is not None:
        run["Cmd"] = config.cmd
    if config.labels:
        run["Labels"] = config.labels
    if config.exposed_ports:
        run["ExposedPorts"] = {p: {} for p in config.exposed_ports}
    document = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": created, "created_by": line} for line in history],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def manifest_document(config: bytes, layers: list[ExportedLayer]) -> bytes:
    document = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {
            "mediaType": CONFIG_TYPE,
            "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
            "size": len(config),
        },
        "layers": [{"mediaType": LAYER_TYPE, "digest": x.digest, "size": x.size} for x in layers],
    }
    return json.dumps(document, separators=(",", ":")).encode()
