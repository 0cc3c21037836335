"""The minimal image store: built-in images built once from Debian packages and cached on disk.

An image resolves to an ``ImageRef``: ordered read-only layers (lowest first) and a config. The
layered, lazily fetched store of issue 3 replaces the internals behind this same interface.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ..errors import BackendError, ImageNotFound, InvalidRequest
from ..models import ImageInfo
from ..proc import run

log = logging.getLogger("dsec.images")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ImageRef:
    name: str
    layers: tuple[Path, ...]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"


def normalize(name: str) -> str:
    if not isinstance(name, str) or len(name) > 256 or not _NAME_RE.match(name):
        raise InvalidRequest(f"invalid image name {name!r}: expected repo[:tag], e.g. dsec/debian:12")
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _dir_name(name: str) -> str:
    # '+' and '@' cannot appear in a valid name, so this mapping is one to one
    return name.replace("/", "+").replace(":", "@")


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _build_busybox(target: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise BackendError("busybox is not installed (apt-get install busybox-static)")
    target.mkdir()
    for d in (
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "root",
        "home",
        "tmp",
        "proc",
        "sys",
        "dev",
        "var/tmp",
    ):
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


async def _build_debian(target: Path) -> None:
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


# Each builder creates its target directory itself (mmdebstrap insists on doing so).
BUILTIN: dict[str, tuple[str, Callable[[Path], Awaitable[None]]]] = {}


async def _busybox(target: Path) -> None:
    await asyncio.to_thread(_build_busybox, target)


BUILTIN["dsec/busybox:latest"] = ("busybox-static userland (fast tests)", _busybox)
BUILTIN["dsec/debian:12"] = (
    "Debian 12 minbase + bash, coreutils, python3, git, ca-certificates",
    _build_debian,
)


class ImageStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, asyncio.Lock] = {}
        # A built image never changes, so a resolved one is not read from disk again (every create).
        self._refs: dict[str, ImageRef] = {}

    def _dir(self, name: str) -> Path:
        return self.root / _dir_name(name)

    def _meta(self, name: str) -> dict[str, object] | None:
        return self._meta_from_dir(self._dir(name))

    def is_ready(self, name: str) -> bool:
        return self._meta(normalize(name)) is not None

    async def resolve(self, name: str, *, build: bool = True) -> ImageRef:
        """The image's layers, building a built-in image on first use."""
        norm = normalize(name)
        if norm in self._refs:
            return self._refs[norm]
        meta = self._meta(norm)
        if meta is None:
            if norm not in BUILTIN:
                raise ImageNotFound(f"image {name!r} not found; `dsec images` lists the available ones")
            if not build:
                raise ImageNotFound(f"image {name!r} is not built yet")
            await self.ensure(norm)
            meta = self._meta(norm) or {}
        env = meta.get("env")
        ref = ImageRef(
            name=norm,
            layers=(self._dir(norm) / "rootfs",),
            env=dict(env) if isinstance(env, dict) else {"PATH": DEFAULT_PATH},
            workdir=str(meta.get("workdir") or "/"),
        )
        self._refs[norm] = ref
        return ref

    async def ensure(self, name: str) -> ImageInfo:
        norm = normalize(name)
        lock = self._locks.setdefault(norm, asyncio.Lock())
        async with lock:
            if self._meta(norm) is None:
                if norm not in BUILTIN:
                    raise ImageNotFound(f"image {name!r} not found and not a built-in image")
                await self._build(norm)
        return self.info(norm)

    async def _build(self, name: str) -> None:
        description, builder = BUILTIN[name]
        final = self._dir(name)
        tmp = self.root / f".build-{_dir_name(name)}-{os.getpid()}-{time.monotonic_ns()}"
        rootfs = tmp / "rootfs"
        log.info("building image %s (%s)", name, description)
        started = time.monotonic()
        try:
            tmp.mkdir(parents=True)
            await builder(rootfs)
            meta = {
                "name": name,
                "description": description,
                "created_at": time.time(),
                "env": {"PATH": DEFAULT_PATH},
                "workdir": "/",
                "size": _du(rootfs),
            }
            (tmp / "image.json").write_text(json.dumps(meta))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                await asyncio.to_thread(shutil.rmtree, tmp, True)
        log.info("built image %s in %.1fs", name, time.monotonic() - started)

    def info(self, name: str) -> ImageInfo:
        norm = normalize(name)
        meta = self._meta(norm)
        if meta is None:
            desc = BUILTIN[norm][0] if norm in BUILTIN else ""
            return ImageInfo(name=norm, size=0, ready=False, description=desc)
        created = meta.get("created_at")
        size = meta.get("size")
        return ImageInfo(
            name=norm,
            size=int(size) if isinstance(size, int) else 0,
            created_at=datetime.fromtimestamp(float(created), UTC) if isinstance(created, int | float) else None,
            ready=True,
            description=str(meta.get("description", "")),
        )

    def list(self) -> list[ImageInfo]:
        names = set(BUILTIN)
        for d in self.root.iterdir():
            if not d.name.startswith(".") and (d / "image.json").exists():
                meta = self._meta_from_dir(d)
                if meta:
                    names.add(str(meta["name"]))
        return [self.info(n) for n in sorted(names)]

    @staticmethod
    def _meta_from_dir(d: Path) -> dict[str, object] | None:
        try:
            data = json.loads((d / "image.json").read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None
