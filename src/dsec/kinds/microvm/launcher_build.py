"""Building the VMM launcher (vmm_launcher.c) into a binary, once per source version, beside the guest assets."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

from .agent_build import compile_static

SOURCE = Path(__file__).with_name("vmm_launcher.c")
BINARY = "dsec-vmm-launcher"
DEFAULT_DIR = Path(os.environ.get("DSEC_VM_CACHE", "/var/cache/dsec/vm")) / "vmm"


@functools.cache  # every QEMU start asks for it: its source is hashed once per process, not per VM
def build(dest_dir: Path = DEFAULT_DIR) -> Path:
    """Compile the launcher into ``dest_dir`` unless the same source was built there; returns the binary.

    Static, so it does not depend on the host's shared libraries while it runs as root before anything is
    jailed; root-only (0500): nobody else has a use for it, and it must not be replaced under the daemon.
    """
    return compile_static(BINARY, (SOURCE,), (), dest_dir, mode=0o500)


async def build_launcher(dest_dir: Path = DEFAULT_DIR) -> Path:
    """:func:`build` off the event loop (a cold build takes about a second)."""
    return await asyncio.to_thread(build, dest_dir)
