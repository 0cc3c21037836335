"""The core's choice between a rollback in place and a creation again (core/checkpoints.py), over a kind
whose in-place step answers, declines or fails as told."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsec.core.checkpoint_files import BASE, CheckpointFiles
from dsec.core.checkpoints import Checkpoints
from dsec.errors import BackendError
from dsec.images.store import ImageRef
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord


class Kind:
    def __init__(self, reroot: Any) -> None:
        self.forks_memory = False
        self._reroot = reroot
        self.calls: list[str] = []

    async def reroot(self, rec: SandboxRecord, image: ImageRef) -> bool:
        self.calls.append(f"reroot {len(image.stack)}")
        if isinstance(self._reroot, Exception):
            raise self._reroot
        return bool(self._reroot)

    def prepare_reroot(self, rec: SandboxRecord, image: ImageRef) -> None:
        self.calls.append(f"prepare {len(image.stack)}")

    async def destroy(self, rec: SandboxRecord) -> None:
        self.calls.append("destroy")

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        self.calls.append(f"create {len(image.stack)}")


class Images:
    async def resolve(self, name: str, version: str | None = None) -> ImageRef:
        return ImageRef(name=name, layers=(Path("/layers/0"),))


def _checkpoints(tmp_path: Path) -> tuple[Checkpoints, SandboxRecord]:
    c = Checkpoints.__new__(Checkpoints)  # only what _start_again uses: the files and the images
    c.files = CheckpointFiles(tmp_path)
    c.images = Images()  # type: ignore[assignment]
    packed = tmp_path / "packed.erofs"
    packed.write_bytes(b"layer")
    c.files.save("sb-1", "c1", [], packed)
    return c, SandboxRecord("sb-1", "container", "dsec/busybox", State.running, 0.0, 1.0, Limits())


@pytest.mark.parametrize(
    ("answer", "calls"),
    [
        (True, ["reroot 1", "prepare 1"]),  # in place: the same root is prepared for the next rollback
        (False, ["reroot 1", "destroy", "create 1"]),
        (BackendError("pivot_root: Invalid argument"), ["reroot 1", "destroy", "create 1"]),
        (RuntimeError("anything else"), ["reroot 1", "destroy", "create 1"]),
    ],
)
async def test_in_place_or_made_again(tmp_path: Path, answer: Any, calls: list[str]) -> None:
    c, rec = _checkpoints(tmp_path)
    kind = Kind(answer)
    made_again = await c._start_again(rec, kind, "c1")  # type: ignore[arg-type]
    assert kind.calls == calls
    assert made_again == ("create 1" in calls)  # the core writes the record again only then
    # either way the sandbox now stands on the checkpoint's layers: a next checkpoint stacks on them
    assert [p.read_bytes() for p in c.files.stack("sb-1", BASE)] == [b"layer"]


async def test_the_base_is_linked_once_for_rollbacks_to_one_checkpoint(tmp_path: Path) -> None:
    c, rec = _checkpoints(tmp_path)
    await c._start_again(rec, Kind(True), "c1")  # type: ignore[arg-type]
    first = c.files.stack("sb-1", BASE)[0].stat().st_ino
    base_dir = (tmp_path / "sb-1" / BASE).stat().st_ino
    await c._start_again(rec, Kind(True), "c1")  # type: ignore[arg-type]
    assert (tmp_path / "sb-1" / BASE).stat().st_ino == base_dir  # not made again
    assert c.files.stack("sb-1", BASE)[0].stat().st_ino == first
    assert c.files.holds_same("sb-1", BASE, c.files.stack("sb-1", "c1"))
    assert not c.files.holds_same("sb-1", BASE, [])
