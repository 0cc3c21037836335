"""Built-in images, built on first use from Debian packages on this node and published as layers."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BackendError
from ..proc import run
from ..protocol.build import LayerRole
from .model import ImageVersion

if TYPE_CHECKING:
    from .store import ImageStore

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


# Built-in images made by a Dockerfile build (images/code/Dockerfile): the core registers how, as only it
# can run the builder sandboxes (ImageStore.recipes); built on first use like the others.
Recipe = Callable[[], Awaitable[None]]
RECIPES: dict[str, tuple[str, Path]] = {
    "dsec/code:1": (
        "Python 3.11 with a Jupyter kernel, numpy, pandas, matplotlib; gcc/g++, Go, a JDK, Node.js (for run_code)",
        Path(__file__).parent / "code" / "Dockerfile",
    ),
    "dsec/e2b-base:1": (
        "E2B's base template: the account user (/home/user) by default; bash, python3 (also as python), git, "
        "curl, procps; a sudo for root only (no_new_privs)",
        Path(__file__).parent / "e2b-base" / "Dockerfile",
    ),
    "dsec/e2b-code-interpreter:1": (
        "dsec/code:1 shaped like dsec/e2b-base:1 (the account user, curl, procps): the e2b-code-interpreter "
        "package's template",
        Path(__file__).parent / "e2b-code-interpreter" / "Dockerfile",
    ),
}

BUILTIN: dict[str, tuple[str, Builder]] = {
    "dsec/busybox:latest": ("busybox-static userland (fast tests)", _busybox),
    "dsec/debian:12": ("Debian 12 minbase + bash, coreutils, python3, git, ca-certificates", _debian),
}


def builtin_names() -> dict[str, str]:
    """Every built-in image's name and description, built or not."""
    return {**{n: d for n, (d, _) in BUILTIN.items()}, **{n: d for n, (d, _) in RECIPES.items()}}


async def build_builtin(store: ImageStore, name: str) -> None:
    """Build one of BUILTIN's images from its root file system and publish it as one base layer."""
    description, builder = BUILTIN[name]
    work = store.layers.tmp / f"build-{secrets.token_hex(4)}"
    try:
        work.mkdir(parents=True)
        await builder(work / "rootfs")
        staged = await store.pack(work / "rootfs", store.scrub, drop_devices=True)
        async with store.catalog.publishing():
            ref = await store.publish_layer(staged, LayerRole.base, f"built-in {name}")
            version = ImageVersion(name=name, layers=[ref], description=description, scrubbed=staged.scan.scrubbed)
            await store.catalog.publish(version)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
