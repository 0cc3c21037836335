"""The core's named volumes over the FakeBackend and a host that only pretends to mount: who may make,
see, mount and remove them, one writer and many readers, holds given back as sandboxes end, and the
in-use table rebuilt after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.core.manager import SandboxManager
from dsec.errors import Forbidden, InvalidRequest, VolumeExists, VolumeInUse, VolumeNotFound
from dsec.images.store import ImageStore
from dsec.protocol.sandbox import CreateSandbox, State
from dsec.protocol.volumes import VolumeCreate
from dsec.store.records import SandboxRecord, VolumeMount
from dsec.tenancy import OPERATOR, Caller

from ...fakes.backend import FakeBackend
from ...fakes.volumes import FakeHost
from ..conftest import IMAGE, new_manager

ALICE, BOB = Caller("alice"), Caller("bob")


def with_host(mgr: SandboxManager, host: FakeHost) -> SandboxManager:
    mgr.volumes.host = host
    return mgr


@pytest.fixture
async def node(workdir: Path) -> AsyncIterator[tuple[SandboxManager, FakeBackend, FakeHost]]:
    mgr, backend = new_manager(workdir)
    host = FakeHost()
    with_host(mgr, host)
    await mgr.start()
    yield mgr, backend, host
    await mgr.close()


def reopen(workdir: Path) -> tuple[SandboxManager, FakeBackend]:
    """The node's manager again, on the same state (a restarted daemon)."""
    images = ImageStore(workdir / "images", lazy=False, mount=False)
    again = SandboxManager(state_dir=workdir / "state", images=images, kinds=["container"])
    backend = again.backends["container"] = FakeBackend(again.ctx)
    return again, backend


def req(volumes: dict[str, object], **kw: object) -> CreateSandbox:
    return CreateSandbox.model_validate({"image": IMAGE, "volumes": volumes, **kw})


async def settle(mgr: SandboxManager) -> None:
    await asyncio.sleep(0)
    await mgr.volumes.close()  # waits for the background unmounts


async def test_made_listed_inspected_removed(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, _, host = node
    info = await mgr.create_volume(VolumeCreate(name="data", size=32 << 20), caller=ALICE)
    assert (info.name, info.size, info.owner, info.users) == ("data", 32 << 20, "alice", [])
    assert info.used == 4
    assert (mgr.volumes.images / "data.ext4").exists()
    with pytest.raises(VolumeExists):
        await mgr.create_volume(VolumeCreate(name="data"), caller=BOB)  # names are the node's, like images'
    assert [v.name for v in mgr.list_volumes(caller=ALICE)] == ["data"]
    assert mgr.list_volumes(caller=BOB) == []
    with pytest.raises(VolumeNotFound):
        mgr.volume("data", caller=BOB)  # another tenant's is answered as missing
    with pytest.raises(VolumeNotFound):
        await mgr.remove_volume("data", caller=BOB)
    assert mgr.volume("data", caller=OPERATOR).owner == "alice"
    await mgr.remove_volume("data", caller=ALICE)
    assert not (mgr.volumes.images / "data.ext4").exists()
    assert mgr.list_volumes() == [] and not host.mounted


async def test_too_large_for_the_disk(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, _, host = node
    host.free_bytes = 100 << 20
    with pytest.raises(InvalidRequest, match="larger than this node's free disk"):
        await mgr.create_volume(VolumeCreate(name="big", size=1 << 30))
    assert mgr.list_volumes() == []  # nothing half-made


async def test_operators_volumes_are_read_only_for_tenants(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, _, _ = node
    await mgr.create_volume(VolumeCreate(name="dataset"))
    assert mgr.volume("dataset", caller=ALICE).owner is None
    with pytest.raises(Forbidden, match="read-only"):
        await mgr.create(req({"/d": "dataset"}), caller=ALICE)
    with pytest.raises(Forbidden):
        await mgr.remove_volume("dataset", caller=ALICE)
    info = await mgr.create(req({"/d": ["dataset", "ro"]}), caller=ALICE)
    assert [(v.path, v.name, v.mode) for v in info.volumes] == [("/d", "dataset", "ro")]


async def test_one_writer_many_readers(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, backend, host = node
    await mgr.create_volume(VolumeCreate(name="v"))
    writer = await mgr.create(req({"/data": "v"}))
    assert host.mounted == {mgr.volumes.mount_point("v")}
    rec = mgr.record(writer.id)
    assert rec.volumes == [VolumeMount("/data", "v", False, str(mgr.volumes.mount_point("v")))]
    before = {s.id for s in mgr.list(include_finished=True)}
    with pytest.raises(VolumeInUse, match=writer.id):
        await mgr.create(req({"/data": "v"}))
    # refused before anything was made: no record, no admission held
    assert {s.id for s in mgr.list(include_finished=True)} == before
    assert len(backend.created) == 1
    readers = [await mgr.create(req({"/r": ["v", "ro"]})) for _ in range(3)]
    users = mgr.volume("v").users
    assert sorted((u.sandbox, u.mode) for u in users) == sorted([(writer.id, "rw")] + [(r.id, "ro") for r in readers])
    assert host.mounts == 1  # one host mount, shared
    await mgr.kill(writer.id)
    second = await mgr.create(req({"/data": "v"}))  # the writer gone, another may write
    for s in [second, *readers]:
        await mgr.kill(s.id)
    await settle(mgr)
    assert mgr.volume("v").users == [] and not host.mounted  # unmounted once nobody uses it


async def test_in_use_cannot_be_removed(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, _, host = node
    await mgr.create_volume(VolumeCreate(name="v"))
    sb = await mgr.create(req({"/data": ["v", "ro"]}))
    with pytest.raises(VolumeInUse, match=sb.id) as caught:
        await mgr.remove_volume("v")
    assert caught.value.detail == {"sandboxes": [sb.id]}
    await mgr.kill(sb.id)
    await mgr.remove_volume("v")  # at once: the removal unmounts it itself
    assert not host.mounted
    with pytest.raises(VolumeNotFound):
        await mgr.create(req({"/data": "v"}))


async def test_a_failed_creation_gives_its_volumes_back(node: tuple[SandboxManager, FakeBackend, FakeHost]) -> None:
    mgr, backend, host = node
    await mgr.create_volume(VolumeCreate(name="v"))
    backend.create_error = RuntimeError("boom")
    with pytest.raises(Exception, match="boom"):
        await mgr.create(req({"/data": "v"}))
    backend.create_error = None
    assert mgr.volume("v").users == []
    await settle(mgr)
    assert not host.mounted
    ok = await mgr.create(req({"/data": "v"}))
    assert mgr.record(ok.id).state == State.running


Node = tuple[SandboxManager, FakeBackend, FakeHost]


async def test_a_kind_that_cannot_mount_them_is_refused_first(node: Node) -> None:
    mgr, backend, _ = node
    await mgr.create_volume(VolumeCreate(name="v"))
    backend.volumes_unsupported = "it has no file system to bind into"  # type: ignore[misc]
    with pytest.raises(InvalidRequest, match="not supported for container sandboxes: it has no file system"):
        await mgr.create(req({"/data": "v"}))
    assert mgr.volume("v").users == []


async def test_holds_are_rebuilt_after_a_restart(workdir: Path) -> None:
    host = FakeHost()
    mgr, _ = new_manager(workdir)
    await with_host(mgr, host).start()
    await mgr.create_volume(VolumeCreate(name="kept"))
    await mgr.create_volume(VolumeCreate(name="idle"))
    keep = await mgr.create(req({"/data": "kept"}))
    dies = await mgr.create(req({"/idle": ["idle", "ro"]}))
    await mgr.close()
    assert host.mounted == {mgr.volumes.mount_point("kept"), mgr.volumes.mount_point("idle")}

    again, backend = reopen(workdir)
    backend.dead.add(dies.id)  # this one did not survive the restart
    await with_host(again, host).start()
    try:
        assert again.record(keep.id).state == State.running
        assert [(u.sandbox, u.mode) for u in again.volume("kept").users] == [(keep.id, "rw")]
        assert again.record(dies.id).state == State.lost
        await settle(again)
        assert again.volume("idle").users == []
        assert host.mounted == {again.volumes.mount_point("kept")}  # the lost one's volume is let go
        with pytest.raises(VolumeInUse):
            await again.create(req({"/data": "kept"}))
        with pytest.raises(VolumeInUse):
            await again.remove_volume("kept")
    finally:
        await again.close()


async def test_start_mounts_what_is_used_and_finishes_cut_short_work(workdir: Path) -> None:
    """A host reboot under running sandboxes is not survivable, but a mount lost some other way is made
    again for the file API of the sandboxes that hold it; half-made volumes and half-removed ones go."""
    host = FakeHost()
    mgr, _ = new_manager(workdir)
    await with_host(mgr, host).start()
    await mgr.create_volume(VolumeCreate(name="v"))
    await mgr.create(req({"/data": "v"}))
    await mgr.close()
    host.mounted.clear()
    # what a daemon that died in a creation or a removal leaves
    (mgr.volumes.images / "half.ext4.new").write_bytes(b"")
    (mgr.volumes.images / "orphan.ext4").write_bytes(b"")
    again, _ = reopen(workdir)
    again.volumes.store.add("unmade", None, 1 << 30)
    await with_host(again, host).start()
    try:
        assert host.mounted == {again.volumes.mount_point("v")}
        assert sorted(p.name for p in again.volumes.images.iterdir()) == ["v.ext4"]
        assert [v.name for v in again.list_volumes()] == ["v"]
    finally:
        await again.close()


def test_records_keep_their_mounts() -> None:
    from dsec.protocol.sandbox import Limits

    rec = SandboxRecord("sb-1", "container", IMAGE, State.running, 0.0, 1.0, Limits())
    rec.volumes = [VolumeMount("/data", "v", True, "/state/volumes/mnt/v")]
    rec.runtime = {"uid_base": 1 << 20}
    stored = rec.persisted()
    back = SandboxRecord("sb-1", "container", IMAGE, State.running, 0.0, 1.0, Limits())
    back.restore(stored)
    assert back.volumes == rec.volumes and back.runtime == {"uid_base": 1 << 20}
    assert [(v.path, v.name, v.mode) for v in back.info().volumes] == [("/data", "v", "ro")]
    back.restore({"volumes": [{"path": 1}, "junk"]})  # a damaged entry is dropped, not trusted
    assert back.volumes == []


async def test_batches_mount_them_too(node: Node) -> None:
    from dsec.core import batch
    from dsec.protocol.node import BatchCreate

    mgr, _, _ = node
    await mgr.create_volume(VolumeCreate(name="v"))
    readers = BatchCreate.model_validate({"count": 3, "sandbox": {"image": IMAGE, "volumes": {"/d": ["v", "ro"]}}})
    events = [e async for e in batch.create_many(mgr, readers, OPERATOR)]
    assert sum(1 for e in events if e.sandbox is not None) == 3
    writers = BatchCreate.model_validate({"count": 2, "sandbox": {"image": IMAGE, "volumes": {"/d": "v"}}})
    events = [e async for e in batch.create_many(mgr, writers, OPERATOR)]
    assert sum(1 for e in events if e.sandbox is not None) == 1  # one writer at a time
    assert [e.error.code for e in events if e.error is not None] == ["volume_in_use"]
    assert sorted(u.mode for u in mgr.volume("v").users) == ["ro", "ro", "ro", "rw"]


async def test_lent_to_the_content_api_for_one_call(node: Node) -> None:
    """A volume nobody mounts is mounted for a content call and unmounted after; a write meanwhile is a
    writer (a sandbox asking to write is refused, readers are not) and the volume cannot be removed."""
    mgr, _, host = node
    await mgr.create_volume(VolumeCreate(name="v"))
    async with mgr.volumes.lend("v", OPERATOR, "ro") as root:
        assert root == mgr.volumes.mount_point("v") and host.mounted == {root}
    await settle(mgr)
    assert host.mounted == set()
    async with mgr.volumes.lend("v", OPERATOR, "rw"):
        with pytest.raises(VolumeInUse, match="E2B content API"):
            await mgr.create(req({"/d": "v"}))
        with pytest.raises(VolumeInUse, match="E2B content API"):
            await mgr.remove_volume("v")
        reader = await mgr.create(req({"/d": ["v", "ro"]}))
    await settle(mgr)
    assert host.mounted == {mgr.volumes.mount_point("v")}  # the reader still uses it
    writer = await mgr.create(req({"/w": "v"}))  # the content write is done
    with pytest.raises(VolumeInUse, match=f"read-write by sandbox {writer.id}"):
        async with mgr.volumes.lend("v", OPERATOR, "rw"):
            pass
    with pytest.raises(Forbidden):
        async with mgr.volumes.lend("v", ALICE, "rw"):
            pass
    for s in (reader, writer):
        await mgr.kill(s.id)
    await settle(mgr)
    assert host.mounted == set()
    await mgr.remove_volume("v")
    with pytest.raises(VolumeNotFound):
        async with mgr.volumes.lend("v", OPERATOR, "ro"):
            pass
