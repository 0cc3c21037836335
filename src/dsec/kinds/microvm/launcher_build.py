"""Building the VMM launcher (vmm_launcher.c) into a binary, once per source version, beside the guest assets."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ...errors import BackendError

SOURCE = Path(__file__).with_name("vmm_launcher.c")
BINARY = "dsec-vmm-launcher"
# Static: it runs as root before anything is jailed, so it should not depend on the host's shared libraries.
CFLAGS = ["-static", "-O2", "-Wall", "-Wextra"]
DEFAULT_DIR = Path(os.environ.get("DSEC_VM_CACHE", "/var/cache/dsec/vm")) / "vmm"


def build(dest_dir: Path = DEFAULT_DIR) -> Path:
    """Compile the launcher into ``dest_dir`` unless the same source was built there; returns the binary."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join(CFLAGS).encode()).hexdigest()
    target = dest_dir / BINARY
    stamp = dest_dir / f"{BINARY}.sha256"
    try:
        if stamp.read_text() == digest and target.exists():
            return target
    except OSError:
        pass
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendError("no C compiler to build dsec's VMM launcher (apt-get install gcc libc6-dev)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    # per-process temporary name: two daemons (or test workers) may build into the same directory
    tmp = dest_dir / f"{BINARY}.{os.getpid()}.tmp"
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False)
    except OSError as e:
        raise BackendError(f"building the VMM launcher failed: {e}") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendError(f"building the VMM launcher failed: {res.stderr[-1500:]}")
    # root-only: nobody else has a use for it, and it must not be replaced under the daemon
    os.chmod(tmp, 0o500)
    tmp.rename(target)
    stamp_tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    stamp_tmp.write_text(digest)
    stamp_tmp.rename(stamp)
    return target


async def build_launcher(dest_dir: Path = DEFAULT_DIR) -> Path:
    """:func:`build` off the event loop (a cold build takes about a second)."""
    return await asyncio.to_thread(build, dest_dir)
