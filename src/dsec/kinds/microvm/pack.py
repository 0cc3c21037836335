"""pack_diff for VMs: the guest's writable layer, frozen, brought to the host in overlayfs format.

The writable layer is a tmpfs inside the guest. ``/init`` leaves it reachable at ``/.dsec/rw`` for the
daemon's own tools; ``/.dsec/pack-upper`` (read-only helper disk) writes its upper directory as an OCI
layer tar, which keeps what busybox cannot (opaque directories, whiteouts, xattrs). The host unpacks
that tar with the same hostile-archive extractor OCI imports use: it comes from the guest, so it is
untrusted. The result is the directory a container's ``frozen_upper`` yields, with the ids the guest
sees, and goes through the same pack as a container's.

While the tar is written, every exec group of the guest agent except the packer's own is frozen
(cgroup v2 ``cgroup.freeze``), so a running workload cannot change the layer under the packer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from ...errors import BackendError, LimitExceeded
from ...images.tar_extract import extract_tar
from .channel import HELPER_ENV, GuestChannel

PACK_TIMEOUT = 900.0
PACKER = "/.dsec/pack-upper"
UPPER = "/.dsec/rw/upper"
BUSYBOX = "/.dsec/busybox"
# Freezes (1) or thaws (0) every sibling of the calling exec's cgroup. Without exec cgroups (the agent
# fell back to process groups) there is nothing to freeze and the script does nothing.
FREEZE = r"""
self=$(/.dsec/busybox sed -n 's/^0:://p' /proc/self/cgroup)
case "$self" in /*/*) ;; *) exit 0 ;; esac
for g in "/sys/fs/cgroup${self%/*}"/*/; do
  [ "$g" = "/sys/fs/cgroup$self/" ] && continue
  [ -e "${g}cgroup.freeze" ] && echo "$1" > "${g}cgroup.freeze"
done
exit 0
"""


async def _freeze(chan: GuestChannel, on: bool) -> None:
    status, _, err = await chan.run_bytes([BUSYBOX, "sh", "-c", FREEZE, "freeze", "1" if on else "0"], None, 30.0)
    if status != 0:
        raise BackendError(f"cannot {'freeze' if on else 'thaw'} the guest's commands: {err[-300:]}")


@contextlib.asynccontextmanager
async def frozen_guest_upper(chan: GuestChannel, work: Path, limit: int) -> AsyncIterator[Path]:
    """The guest's upper directory unpacked under ``work`` (removed afterwards), the guest frozen meanwhile.

    ``limit``: the most tar bytes accepted (the writable layer's size plus the archive's overhead).
    """
    await asyncio.to_thread(shutil.rmtree, work, True)
    await asyncio.to_thread(work.mkdir, parents=True)
    tar_path = work / "upper.tar"
    upper = work / "upper"
    await _freeze(chan, True)
    try:
        fd = os.open(tar_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        written = 0

        def sink(stream: str, data: bytes) -> None:
            nonlocal written
            if stream != "stdout":
                return
            written += len(data)
            if written > limit:
                raise LimitExceeded(f"the packed writable layer exceeds {limit} bytes")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]

        try:
            res = await chan.run([PACKER, UPPER], HELPER_ENV, "/", None, PACK_TIMEOUT, 64 << 10, sink)
        finally:
            os.close(fd)
        if res.timed_out or res.exit_code != 0:
            why = "timed out" if res.timed_out else f"exit {res.exit_code}"
            raise BackendError(f"packing the guest's writable layer failed ({why}): {res.stderr[-500:]}")

        def unpack() -> None:
            with open(tar_path, "rb") as f:
                extract_tar(f, upper, label="the guest's writable layer")
            tar_path.unlink()

        await asyncio.to_thread(unpack)
        yield upper
    finally:
        try:
            await _freeze(chan, False)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
