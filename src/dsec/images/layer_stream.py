"""A layer's byte stream as it is read from an image: hashed as it goes, decompressed, classified on failure."""

from __future__ import annotations

import errno
import gzip
import hashlib
import importlib
import tarfile
import zlib
from types import ModuleType
from typing import Literal, Protocol

from ..errors import BackendError, DsecError, InvalidRequest

Compression = Literal["none", "gzip", "zstd"]

CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# what decompressors and tarfile raise on damaged input (gzip.BadGzipFile is an OSError: check it first);
# IndexError: tarfile indexes a GNU sparse extension block that the archive ends before
CORRUPT: tuple[type[BaseException], ...] = (
    tarfile.TarError,
    EOFError,
    zlib.error,
    gzip.BadGzipFile,
    ValueError,
    IndexError,
)
READ_ERRORS: tuple[type[BaseException], ...] = (*CORRUPT, OSError)


class Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def read_failure(exc: BaseException, label: str) -> DsecError:
    """Classify an exception raised while reading a layer: damaged data, or the local disk failing."""
    if isinstance(exc, DsecError):
        return exc
    # zstandard's error type is only known when the optional module is installed
    if isinstance(exc, CORRUPT) or type(exc).__name__ == "ZstdError":
        return InvalidRequest(f"{label}: corrupt or truncated archive ({exc})")
    return BackendError(f"{label}: read failed: {exc}")


class HashingReader:
    """A read-through sha256 of everything read from ``src``."""

    def __init__(self, src: Reader) -> None:
        self.src = src
        self.sha = hashlib.sha256()
        self.size = 0
        self.head = b""

    def read(self, size: int = -1, /) -> bytes:
        data = self.src.read(size)
        if not self.head:
            self.head = data[:4]
        self.sha.update(data)
        self.size += len(data)
        return data

    def seek(self, pos: int, /) -> int:
        raise OSError(errno.ESPIPE, "layer streams are read once, front to back")

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def zstd_module() -> ModuleType | None:
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        return None


def check_compression(compression: Compression, where: str) -> None:
    if compression == "zstd" and zstd_module() is None:
        raise InvalidRequest(
            f"layer {where} is zstd-compressed, which needs the Python module 'zstandard' (not installed); "
            "re-export the image with gzip-compressed or uncompressed layers"
        )


def decompress(src: HashingReader, compression: Compression) -> Reader:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=src, mode="rb")
    if compression == "zstd":
        zstd = zstd_module()
        if zstd is None:
            raise InvalidRequest("zstd-compressed layer, and the Python module 'zstandard' is not installed")
        reader: Reader = zstd.ZstdDecompressor().stream_reader(src, read_across_frames=True)
        return reader
    return src


def sniff(head: bytes) -> Compression:
    # The bytes decide, not the media type: mislabelled layers exist and tools (containerd) cope.
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"
