"""Built-in images, built on first use from Debian packages on this node and published as layers."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..errors import BackendError
from ..proc import run

# Each builder creates its target directory itself (mmdebstrap insists on doing so).
Builder = Callable[[Path], Awaitable[None]]


def _build_busybox(target: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise BackendError("busybox is not installed (apt-get install busybox-static)")
    target.mkdir()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home", "tmp", "proc", "sys", "dev", "var/tmp"):
        (target / d).mkdir(parents=True, exist_ok=True)
    os.chmod(target / "tmp", 0o1777)
    os.chmod(target / "var/tmp", 0o1777)
    shutil.copy2(busybox, target / "bin/busybox")
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    for applet in applets:
        link = target / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (target / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (target / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (target / "etc/hostname").write_text("sandbox\n")


async def _busybox(target: Path) -> None:
    await asyncio.to_thread(_build_busybox, target)


async def _debian(target: Path) -> None:
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise BackendError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    argv = [
        mmdebstrap,
        "--variant=minbase",
        "--include=bash,coreutils,python3,git,ca-certificates",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "bookworm",
        str(target),
    ]
    status, out = await run(argv, timeout=1800)
    if status != 0:
        tail = out.decode(errors="replace")[-2000:]
        raise BackendError(f"mmdebstrap failed with status {status}: {tail}")


BUILTIN: dict[str, tuple[str, Builder]] = {
    "dsec/busybox:latest": ("busybox-static userland (fast tests)", _busybox),
    "dsec/debian:12": ("Debian 12 minbase + bash, coreutils, python3, git, ca-certificates", _debian),
}
