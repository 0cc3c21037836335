"""A full state database (the chaos bench's state-disk-full, here in the core's logic): a transition that
starts something is refused clearly and changes nothing; one that ends a sandbox still tears it down,
its record written once the database takes it. And a sandbox found dead is released, not only marked."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator

import pytest

from dsec.core.manager import SandboxManager
from dsec.errors import DsecError, SandboxGone, StorageFull, environment_error
from dsec.protocol.sandbox import CreateSandbox, ExecRequest, State
from dsec.store.records import SandboxRecord

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE

Core = tuple[SandboxManager, FakeBackend]


def full_database_error() -> sqlite3.OperationalError:
    """The error SQLite gives when its file cannot grow, made by a real database that is full."""
    db = sqlite3.connect(":memory:")
    db.execute("PRAGMA max_page_count = 2")
    db.execute("CREATE TABLE t (x)")
    try:
        for _ in range(100):
            db.execute("INSERT INTO t VALUES (?)", ("x" * 4096,))
    except sqlite3.OperationalError as e:
        return e
    finally:
        db.close()
    raise AssertionError("the database never filled")


@pytest.fixture
def disk_full(core: Core) -> Iterator[list[bool]]:
    """While ``full[0]`` is true, every write of a sandbox record fails as on a full disk."""
    mgr, _ = core
    full = [False]
    put = mgr.store.put

    def put_unless_full(rec: SandboxRecord) -> None:
        if full[0]:
            raise full_database_error()
        put(rec)

    mgr.store.put = put_unless_full  # type: ignore[method-assign]
    yield full


def test_a_full_database_is_a_clear_error() -> None:
    err = environment_error(full_database_error())
    assert isinstance(err, StorageFull) and isinstance(err, OSError)
    assert err.code == "storage_full" and err.http_status == 507
    assert environment_error(OSError(28, "No space left on device", "/var/lib/dsec/x")) is not None
    assert environment_error(sqlite3.OperationalError("no such table: t")) is None
    assert environment_error(ValueError("x")) is None


async def test_a_creation_that_cannot_be_recorded_is_refused_and_leaves_nothing(
    core: Core, disk_full: list[bool]
) -> None:
    mgr, backend = core
    disk_full[0] = True
    with pytest.raises(StorageFull):
        await mgr.create(CreateSandbox(image=IMAGE))
    assert backend.created == [] and mgr.sandboxes.live() == []
    assert mgr.admission.admitted == 0  # its claim was given back


async def test_kill_on_a_full_disk_tears_down_and_records_later(core: Core, disk_full: list[bool]) -> None:
    mgr, backend = core
    info = await mgr.create(CreateSandbox(image=IMAGE))
    disk_full[0] = True
    assert (await mgr.kill(info.id)).state == State.stopped
    assert backend.destroyed == [info.id]
    assert mgr.info(info.id).state == State.stopped  # the caller sees the truth, not the stale record
    stale = mgr.store.get(info.id)
    assert stale is not None and stale.state == State.running
    await mgr.reap_once()  # still full: kept
    assert info.id in mgr.records.unsaved
    disk_full[0] = False
    await mgr.reap_once()
    written = mgr.store.get(info.id)
    assert written is not None and written.state == State.stopped
    assert mgr.records.unsaved == {}


async def test_pause_that_cannot_be_recorded_changes_nothing(core: Core, disk_full: list[bool]) -> None:
    mgr, _ = core
    info = await mgr.create(CreateSandbox(image=IMAGE))
    disk_full[0] = True
    with pytest.raises(StorageFull):
        await mgr.pause(info.id)
    assert mgr.info(info.id).state == State.running
    disk_full[0] = False
    assert (await mgr.exec(info.id, ExecRequest(cmd="true"))).exit_code == 0


async def test_a_sandbox_found_dead_is_released(core: Core) -> None:
    mgr, backend = core
    info = await mgr.create(CreateSandbox(image=IMAGE))
    backend.exec_error = SandboxGone("the VM is gone")
    with pytest.raises(SandboxGone):
        await mgr.exec(info.id, ExecRequest(cmd="true"))
    for _ in range(100):
        if backend.destroyed:
            break
        await asyncio.sleep(0.01)
    assert backend.destroyed == [info.id]
    assert mgr.info(info.id).state == State.failed


async def test_a_failed_creation_keeps_no_lock(core: Core) -> None:
    mgr, backend = core
    backend.create_error = RuntimeError("crun failed")
    for _ in range(3):
        with pytest.raises(DsecError):
            await mgr.create(CreateSandbox(image=IMAGE))
    assert mgr.sandboxes.held_locks() == 0
