"""The state machine on its own (core/sandboxes.py): what every part of the core acts through."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsec.core.admission import Admission, AdmissionOptions
from dsec.core.record_writes import RecordWrites
from dsec.core.sandboxes import Sandboxes
from dsec.errors import InvalidState, SandboxGone, SandboxNotFound
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord, new_record
from dsec.store.sqlite import SandboxStore
from dsec.tenancy import Caller


@pytest.fixture
def table(tmp_path: Path) -> Sandboxes:
    store = SandboxStore(tmp_path / "state.db")
    return Sandboxes(store, RecordWrites(store), Admission(AdmissionOptions()), {})


def _rec(owner: str = "alice") -> SandboxRecord:
    rec = new_record("container", "img", "", 60.0, Limits(), {}, {})
    rec.owner = owner
    return rec


def test_another_tenants_sandbox_is_answered_like_a_missing_one(table: Sandboxes) -> None:
    rec = _rec("alice")
    table.adopt(rec)
    assert table.get(rec.id, Caller("alice")) is rec
    with pytest.raises(SandboxNotFound) as theirs:
        table.get(rec.id, Caller("bob"))
    with pytest.raises(SandboxNotFound) as missing:
        table.get("sb-nope", Caller("bob"))
    assert str(theirs.value).replace(rec.id, "X") == str(missing.value).replace("sb-nope", "X")
    with pytest.raises(SandboxNotFound):
        table.get("x" * 65)


def test_states_move_records_in_and_out_of_the_live_table(table: Sandboxes) -> None:
    rec = _rec()
    table.adopt(rec)
    with pytest.raises(InvalidState, match="creating"):
        table.running(rec.id)
    table.set_state(rec, State.failed, "it broke")
    assert not table.is_live(rec.id) and table.live() == []
    with pytest.raises(SandboxGone, match="it broke"):
        table.running(rec.id)
    assert table.store.get(rec.id) is not None  # written through, still answered after it ended


def test_an_ephemeral_sandbox_is_never_recorded(table: Sandboxes) -> None:
    rec = _rec()
    table.adopt(rec, persist=False)
    table.set_state(rec, State.running)
    assert table.is_live(rec.id) and table.store.get(rec.id) is None


def test_commands_in_flight_are_counted_until_they_end(table: Sandboxes) -> None:
    with table.busy("sb-1"), table.busy("sb-1"):
        assert table.commands_running("sb-1") == 2
    assert table.commands_running("sb-1") == 0


async def test_writes_wait_while_the_writable_layer_is_packed(table: Sandboxes) -> None:
    order: list[str] = []

    async def write() -> None:
        await table.not_packing("sb-1")
        order.append("write")

    async with table.packing("sb-1"):
        task = asyncio.create_task(write())
        await asyncio.sleep(0.01)
        order.append("packed")
    await asyncio.wait_for(task, 5)
    assert order == ["packed", "write"]
