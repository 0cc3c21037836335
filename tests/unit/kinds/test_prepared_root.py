"""The container kind's next root, prepared ahead of a rollback (kinds/container/checkpointing.py): when
one is made, when a rollback may use it, and that a failed preparation only means mounting it then.
The mounting itself is tested on a real sandbox (tests/integration/test_checkpoints.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import BackendError
from dsec.images.store import ImageRef
from dsec.kinds.container import reroot
from dsec.kinds.container.checkpointing import ContainerCheckpoints
from dsec.kinds.container.reroot import prepare_next
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord


class Roots:
    """Where the sandbox's mounts are: runs what it is given, or fails as told."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.ran: list[tuple[str, bool]] = []

    def init_of(self, sid: str) -> int | None:
        return 4242

    async def inside(self, sid: str, fn: Any, *args: object, own: bool = False) -> Any:
        self.ran.append((fn.__name__, own))
        if self.fail is not None:
            raise self.fail
        return None


@pytest.fixture(autouse=True)
def _no_settling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reroot, "SETTLE_S", 0.0)  # the wait is tested on its own below


async def _begun(kind: ContainerCheckpoints) -> None:
    """Until every preparation asked for has begun (a rollback then waits for it, not cancels it)."""
    for _ in range(100):
        if all(p.begun() for p in kind._next_roots.values()):
            return
        await asyncio.sleep(0.001)


def _kind(tmp_path: Path, roots: Roots) -> ContainerCheckpoints:
    kind = ContainerCheckpoints.__new__(ContainerCheckpoints)  # only the preparation's own parts
    kind.sandbox_dir = tmp_path / "sandboxes"
    kind.roots = roots  # type: ignore[assignment]
    kind._next_roots = {}
    kind._old_roots = {}
    return kind


def _rec(**runtime: Any) -> SandboxRecord:
    rec = SandboxRecord("sb-1", "container", "dsec/busybox", State.running, 0.0, 1.0, Limits())
    rec.runtime.update({"init": "agent", **runtime})
    return rec


def _image(tmp_path: Path, *names: str) -> ImageRef:
    stack = []
    for name in names:
        layer = tmp_path / f"{name}.erofs"
        if not layer.exists():
            layer.write_bytes(name.encode())
        stack.append(layer)
    return ImageRef(name="dsec/busybox", layers=(tmp_path / "image-layer",), stack=tuple(stack))


async def test_a_prepared_root_serves_a_rollback_to_what_it_was_made_of(tmp_path: Path) -> None:
    roots = Roots()
    kind, rec = _kind(tmp_path, roots), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    assert await kind._ready_root(rec, c1)
    assert roots.ran == [(prepare_next.__name__, True)]  # never in the host's namespace
    assert "sb-1" not in kind._next_roots  # taken: the next rollback prepares its own

    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    assert not await kind._ready_root(rec, _image(tmp_path, "c1", "c2"))  # another checkpoint: mounted then


async def test_a_checkpoint_saved_again_under_its_name_is_not_the_prepared_one(tmp_path: Path) -> None:
    kind, rec = _kind(tmp_path, Roots()), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    layer = c1.stack[0]
    os.unlink(layer)
    layer.write_bytes(b"other files")  # the same path, another file
    assert not await kind._ready_root(rec, c1)


async def test_a_changed_disk_limit_is_not_the_prepared_root(tmp_path: Path) -> None:
    kind, rec = _kind(tmp_path, Roots()), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    rec.limits = Limits(disk=rec.limits.disk * 2)
    assert not await kind._ready_root(rec, c1)


@pytest.mark.parametrize("fail", [OSError(3, "no such process"), BackendError("mount: no space")])
async def test_a_failed_preparation_only_means_mounting_at_the_rollback(tmp_path: Path, fail: Exception) -> None:
    roots = Roots(fail)
    kind, rec = _kind(tmp_path, roots), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    assert not await kind._ready_root(rec, c1)
    assert roots.ran  # it was tried


async def test_a_preparation_waits_for_the_old_roots_unmount_and_the_one_before(tmp_path: Path) -> None:
    roots = Roots()
    kind, rec = _kind(tmp_path, roots), _rec()
    unmounted = asyncio.Event()

    async def unmount() -> None:
        await unmounted.wait()

    kind._old_roots["sb-1"] = asyncio.create_task(unmount())
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    kind.prepare_reroot(rec, c1)  # a second hint: after the first, never beside it
    await asyncio.sleep(0.01)
    assert roots.ran == []  # both wait for the unmount: the same directory
    unmounted.set()
    await _begun(kind)
    assert await kind._ready_root(rec, c1)
    assert len(roots.ran) == 2


async def test_a_rollback_before_the_preparation_began_mounts_its_root_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reroot, "SETTLE_S", 30.0)  # the preparation would begin long after
    roots = Roots()
    kind, rec = _kind(tmp_path, roots), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    first = kind._next_roots["sb-1"].task
    kind.prepare_reroot(rec, c1)  # waits for the first
    second = kind._next_roots["sb-1"].task
    assert not await asyncio.wait_for(kind._ready_root(rec, c1), 1)  # no wait for either
    await asyncio.sleep(0)
    assert first.cancelled() and second.cancelled() and roots.ran == []


async def test_a_rollback_waits_for_a_preparation_under_way(tmp_path: Path) -> None:
    release = asyncio.Event()

    class SlowRoots(Roots):
        async def inside(self, sid: str, fn: Any, *args: object, own: bool = False) -> Any:
            await release.wait()
            return await super().inside(sid, fn, *args, own=own)

    kind, rec = _kind(tmp_path, SlowRoots()), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    await _begun(kind)
    ready = asyncio.create_task(kind._ready_root(rec, c1))
    await asyncio.sleep(0.01)
    assert not ready.done()  # mounting: the same directory the rollback would mount in
    release.set()
    assert await ready


@pytest.mark.parametrize("runtime", [{"init": "catatonit"}, {"worker": True}])
async def test_nothing_is_prepared_where_a_rollback_cannot_be_in_place(tmp_path: Path, runtime: Any) -> None:
    kind, rec = _kind(tmp_path, Roots()), _rec(**runtime)
    kind.prepare_reroot(rec, _image(tmp_path, "c1"))
    assert kind._next_roots == {}


async def test_a_sandbox_that_ends_forgets_its_preparation(tmp_path: Path) -> None:
    kind, rec = _kind(tmp_path, Roots()), _rec()
    c1 = _image(tmp_path, "c1")
    kind.prepare_reroot(rec, c1)
    kind.forget_prepared("sb-1")
    assert kind._next_roots == {} and kind._old_roots == {}
    assert not await kind._ready_root(rec, c1)
