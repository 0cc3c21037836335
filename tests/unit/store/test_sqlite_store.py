from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord
from dsec.store.sqlite import SandboxStore


def rec(sid: str, state: State = State.running, created: float = 100.0, expires: float = 200.0) -> SandboxRecord:
    return SandboxRecord(
        id=sid,
        kind="container",
        image="test/img:1",
        state=state,
        created_at=created,
        expires_at=expires,
        limits=Limits(memory="256Mi", cpu=0.5, cpu_limit=2, pids=64),
        env={"A": "1", "UNICODE": "é"},
        labels={"team": "x"},
        reason=None,
        runtime={"bundle": "/run/x", "pid": 42},
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SandboxStore]:
    s = SandboxStore(tmp_path / "state.db")
    yield s
    s.close()


def test_get_missing(store: SandboxStore) -> None:
    assert store.get("sb-nope") is None
    assert store.all() == []


def test_put_get_round_trip(store: SandboxStore) -> None:
    original = rec("sb-1")
    store.put(original)
    assert store.get("sb-1") == original


def test_put_replaces(store: SandboxStore) -> None:
    r = rec("sb-1")
    store.put(r)
    r.state = State.failed
    r.reason = "creation failed: boom"
    r.runtime["extra"] = [1, 2]
    store.put(r)
    got = store.get("sb-1")
    assert got is not None
    assert got.state == State.failed
    assert got.reason == "creation failed: boom"
    assert got.runtime == {"bundle": "/run/x", "pid": 42, "extra": [1, 2]}
    assert len(store.all()) == 1


def test_all_is_ordered_by_creation_and_filters_by_state(store: SandboxStore) -> None:
    store.put(rec("sb-c", State.stopped, created=3))
    store.put(rec("sb-a", State.running, created=1))
    store.put(rec("sb-b", State.failed, created=2))
    store.put(rec("sb-d", State.creating, created=4))
    assert [r.id for r in store.all()] == ["sb-a", "sb-b", "sb-c", "sb-d"]
    assert [r.id for r in store.all({State.running})] == ["sb-a"]
    assert [r.id for r in store.all({State.stopped, State.failed})] == ["sb-b", "sb-c"]
    assert store.all({State.lost}) == []


def test_delete_older_than(store: SandboxStore) -> None:
    store.put(rec("sb-old-stopped", State.stopped, expires=10))
    store.put(rec("sb-old-running", State.running, expires=10))
    store.put(rec("sb-new-stopped", State.stopped, expires=1000))
    store.put(rec("sb-old-lost", State.lost, expires=10))
    deleted = store.delete_older_than(500, {State.stopped, State.lost})
    assert deleted == 2
    assert {r.id for r in store.all()} == {"sb-old-running", "sb-new-stopped"}


def test_delete_older_than_is_strict(store: SandboxStore) -> None:
    store.put(rec("sb-1", State.stopped, expires=500))
    assert store.delete_older_than(500, {State.stopped}) == 0
    assert store.delete_older_than(500.001, {State.stopped}) == 1


def test_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SandboxStore(path)
    first.put(rec("sb-1"))
    first.put(rec("sb-2", State.stopped))
    first.close()
    second = SandboxStore(path)
    try:
        assert [r.id for r in second.all()] == ["sb-1", "sb-2"]
        assert second.get("sb-1") == rec("sb-1")
        assert [r.id for r in second.all({State.stopped})] == ["sb-2"]
    finally:
        second.close()


def test_two_connections_see_each_other(tmp_path: Path) -> None:
    a = SandboxStore(tmp_path / "state.db")
    b = SandboxStore(tmp_path / "state.db")
    try:
        a.put(rec("sb-1"))
        assert b.get("sb-1") is not None
    finally:
        a.close()
        b.close()


def test_the_cores_fields_are_kept_apart_from_the_kinds_state(store: SandboxStore) -> None:
    r = rec("sb-typed")
    r.node, r.trajectory, r.forked_from = "n1", "t-1", "sb-parent"
    r.timings = {"queue": 0.5, "total": 1.25}
    r.network = "full"
    r.accelerator, r.started_from, r.waiting = "tcg", "snapshot", None
    store.put(r)
    got = store.get("sb-typed")
    assert got is not None
    assert got.runtime == {"bundle": "/run/x", "pid": 42}  # the kind's state, and only it
    assert (got.node, got.trajectory, got.forked_from, got.network) == ("n1", "t-1", "sb-parent", "full")
    assert got.timings == {"queue": 0.5, "total": 1.25}
    assert (got.accelerator, got.started_from, got.waiting) == ("tcg", "snapshot", None)
    assert got.info().started_from == "fork"  # a copy says so, whatever its kind reported


def test_a_record_written_before_typed_fields_reads_the_same(store: SandboxStore) -> None:
    old = rec("sb-old")
    # what an older daemon wrote: everything in the one runtime object, a VM's start as "restored"
    old.runtime = {"pid": 7, "node": "n0", "trajectory": "t-0", "timings": {"total": 2.0}, "restored": False}
    old.runtime["network"] = {"allow": ["example.com:443"]}
    store.put(old)
    got = store.get("sb-old")
    assert got is not None
    assert got.runtime == {"pid": 7}
    assert (got.node, got.trajectory, got.timings, got.started_from) == ("n0", "t-0", {"total": 2.0}, "boot")
    network = got.info().network
    assert network is not None and network != "full" and network.allow == ["example.com:443"]
