"""A host for named volumes that only pretends to mount them (core/volumes.py's VolumeHost)."""

from __future__ import annotations

from pathlib import Path


class FakeHost:
    """Volumes as small files, "mounted" by name: what the node would do, without the kernel."""

    def __init__(self) -> None:
        self.mounted: set[Path] = set()
        self.mounts = 0
        self.free_bytes = 1 << 40

    def unavailable(self) -> str | None:
        return None

    async def make(self, image: Path, size: int) -> None:
        image.write_bytes(b"ext4")  # noqa: ASYNC240 - a few bytes on a test's tmpfs

    def mount(self, image: Path, target: Path) -> None:
        assert image.exists(), "mounting a volume that has no image"
        target.mkdir(parents=True, exist_ok=True)
        self.mounted.add(target)
        self.mounts += 1

    def unmount(self, target: Path) -> None:
        self.mounted.discard(target)

    def is_mounted(self, target: Path) -> bool:
        return target in self.mounted

    def used(self, image: Path) -> int:
        return image.stat().st_size if image.exists() else 0

    def free(self, directory: Path) -> int:
        return self.free_bytes
