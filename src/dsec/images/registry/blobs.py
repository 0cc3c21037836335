"""Blobs (layers, configs) from a registry: streamed, verified against their digest, resumed when cut.

A blob is named by its sha256 and its size is known from the manifest before the first byte arrives, so a
blob over the caller's bound is refused without fetching it, and a registry that sends more than the size is
stopped at once. When the connection drops mid-blob the transfer goes on from the byte it reached with an
HTTP Range request (a registry that ignores the range sends the blob from its start, and the part already
had is skipped), after a backoff; a run of failed tries that make no progress ends it. The digest is checked
at the end: the bytes streamed before that are the caller's to throw away if it fails.

:func:`download_blob` writes to a temporary file beside the destination and renames it only once the digest
matched, so a failed or cancelled download leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ...errors import DigestMismatch, DsecError, LimitExceeded, NotFound, RegistryError, RegistryUnreachable
from .hosts import Endpoint
from .manifest import Descriptor
from .reference import Reference, check_digest
from .transport import RegistryAnswer, Retriable, Transport, describe

__all__ = ["BlobDownload", "BlobProgress", "blob_chunks", "download_blob"]

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes handed on (and written) at a time
MAX_RESUMES = 100  # in all, however much each try progressed: a registry cutting every connection ends too
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

Progress = Callable[[int, int], None]  # (bytes so far, size)


@dataclass
class BlobProgress:
    """What a transfer went through, filled in as it goes: how many times it resumed and from where."""

    resumes: int = 0  # answers that went on from where an earlier one broke off
    served_by: str = ""
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BlobDownload:
    path: Path
    digest: str
    size: int
    resumes: int
    served_by: str


def _not_found(ref: Reference, endpoint: Endpoint, digest: str) -> Callable[[RegistryAnswer], DsecError]:
    def make(answer: RegistryAnswer) -> DsecError:
        said = f" ({answer.text})" if answer.text else ""
        return NotFound(f"{endpoint.label()} has no blob {digest} in repository {ref.repository}{said}")

    return make


def _skip_for(response: httpx.Response, offset: int, size: int, where: str) -> int:
    """How many leading bytes of ``response`` are already had: 0 for a range answer from ``offset``,
    ``offset`` when the registry sent the whole blob."""
    if response.status_code == 206:
        m = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", "").strip())
        if m is None or int(m[1]) != offset or (m[3] != "*" and int(m[3]) != size):
            raise RegistryError(
                f"{where}: a range answer for byte {offset} on is {response.headers.get('content-range')!r}"
            )
        return 0
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) != size:
        raise DigestMismatch(f"{where} is served as {int(length)} bytes, but its descriptor says {size}")
    return offset


class _Stream:
    """One blob's transfer: where it got to, its running hash, the endpoint it is on."""

    def __init__(
        self, transport: Transport, ref: Reference, desc: Descriptor, progress: Progress | None, stats: BlobProgress
    ) -> None:
        self.transport = transport
        self.ref = ref
        self.desc = desc
        self.progress = progress
        self.stats = stats
        self.offset = 0
        self.sha = hashlib.sha256()
        self.endpoints = transport.hosts.endpoints(ref.registry)
        self.current = 0

    @property
    def endpoint(self) -> Endpoint:
        return self.endpoints[self.current]

    def where(self) -> str:
        return f"blob {self.desc.digest} of {self.ref.name} from {self.endpoint.label()}"

    async def attempt(self) -> AsyncGenerator[bytes, None]:
        """One connection's worth of the blob, from ``offset`` on."""
        # the blob's bytes as stored: a transfer encoding would change what the digest is checked over
        headers = {"Accept-Encoding": "identity"}
        if self.offset:
            headers["Range"] = f"bytes={self.offset}-"
        scope = f"repository:{self.ref.repository}:pull"
        path = f"/v2/{self.ref.repository}/blobs/{self.desc.digest}"
        not_found = _not_found(self.ref, self.endpoint, self.desc.digest)
        what = f"blob {self.desc.digest}"
        async with self.transport.attempt(
            self.endpoint, path, scope=scope, headers=headers, what=what, not_found=not_found
        ) as response:
            skip = _skip_for(response, self.offset, self.desc.size, self.where())
            if self.offset:
                self.stats.resumes += 1
            try:
                # as it arrives (no re-chunking): what came before a dropped connection is kept
                async for chunk in response.aiter_raw():
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                        if not chunk:
                            continue
                    if self.offset + len(chunk) > self.desc.size:
                        raise DigestMismatch(f"{self.where()} runs past its descriptor's size of {self.desc.size}")
                    self.sha.update(chunk)
                    self.offset += len(chunk)
                    if self.progress is not None:
                        self.progress(self.offset, self.desc.size)
                    yield chunk
            except httpx.TransportError as e:
                raise Retriable(_unreachable(self.where(), self.offset, e)) from None
        if self.offset < self.desc.size:
            raise Retriable(_ended(self.where(), self.offset, self.desc.size))


def _unreachable(where: str, offset: int, exc: BaseException) -> RegistryError:
    return RegistryUnreachable(f"{where}: the connection failed at byte {offset}: {describe(exc)}")


def _ended(where: str, offset: int, size: int) -> RegistryError:
    return RegistryUnreachable(f"{where}: the answer ended at byte {offset} of {size}")


async def blob_chunks(
    transport: Transport,
    ref: Reference,
    desc: Descriptor,
    *,
    max_size: int,
    progress: Progress | None = None,
    stats: BlobProgress | None = None,
) -> AsyncGenerator[bytes, None]:
    """The bytes of blob ``desc`` of ``ref``'s repository, in order, resumed across dropped connections and
    across mirrors (a mirror that fails hands over to the next endpoint at the byte reached). Raises
    DigestMismatch after the last chunk if the content is not what the digest names."""
    check_digest(desc.digest, f"blob of {ref.name}")
    if desc.size > max_size:
        raise LimitExceeded(f"blob {desc.digest} of {ref.name} is {desc.size} bytes, over the limit of {max_size}")
    stats = stats if stats is not None else BlobProgress()
    stream = _Stream(transport, ref, desc, progress, stats)
    policy = transport.retry
    failures = 0
    error: DsecError
    while True:
        reached = stream.offset
        try:
            async with contextlib.aclosing(stream.attempt()) as chunks:
                async for chunk in chunks:
                    yield chunk
            break
        except Retriable as r:
            error, delay, final = r.error, r.delay, False
        except (NotFound, RegistryError) as e:  # another try of the same endpoint would get the same
            error, delay, final = e, None, True
        stats.errors.append(str(error))
        failures = 0 if stream.offset > reached else failures + 1
        exhausted = final or failures >= policy.attempts
        last = stream.current + 1 >= len(stream.endpoints)
        if len(stats.errors) > MAX_RESUMES or (exhausted and last):
            raise error
        if exhausted:
            log.warning("%s; going on with the next endpoint", error)
            stream.current, failures, delay = stream.current + 1, 0, 0.0
        log.info("%s; trying again from byte %d", error, stream.offset)
        await asyncio.sleep(delay if delay is not None else policy.delay(failures))
    stats.served_by = stream.endpoint.label()
    got = "sha256:" + stream.sha.hexdigest()
    if got != desc.digest:
        raise DigestMismatch(f"blob {desc.digest} of {ref.name} from {stats.served_by} has digest {got}: refused")


async def download_blob(
    transport: Transport,
    ref: Reference,
    desc: Descriptor,
    dest: Path,
    *,
    max_size: int,
    progress: Progress | None = None,
) -> BlobDownload:
    """Blob ``desc`` into the file ``dest``, verified; nothing is left at ``dest`` or beside it on failure."""
    stats = BlobProgress()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    temp = Path(temp_name)
    done = False
    try:
        chunks = blob_chunks(transport, ref, desc, max_size=max_size, progress=progress, stats=stats)
        with os.fdopen(fd, "wb") as f:
            async with contextlib.aclosing(chunks):  # a failed write closes the registry's answer at once
                pending: list[bytes] = []
                buffered = 0
                async for chunk in chunks:
                    pending.append(chunk)
                    buffered += len(chunk)
                    if buffered >= CHUNK:
                        # off the event loop: a disk under writeback pressure may block a write for long
                        await asyncio.to_thread(f.write, b"".join(pending))
                        pending, buffered = [], 0
            if pending:
                await asyncio.to_thread(f.write, b"".join(pending))
            await asyncio.to_thread(f.flush)
            await asyncio.to_thread(os.fsync, f.fileno())  # on disk before it has its name
        os.replace(temp, dest)
        done = True
    finally:
        if not done:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
    return BlobDownload(dest, desc.digest, desc.size, stats.resumes, stats.served_by)
