"""Checkpoints' layer files: stacks kept as hard links, so removing one checkpoint never takes a layer
another stands on, sizes counted once per file, and what a stopped daemon left swept."""

from __future__ import annotations

from pathlib import Path

from dsec.core.checkpoint_files import BASE, CheckpointFiles
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import CheckpointRecord, SandboxRecord


def on_disk(paths: list[Path]) -> int:
    return sum(p.stat().st_blocks * 512 for p in paths)


def _packed(files: CheckpointFiles, sid: str, data: bytes) -> Path:
    blob = files.scratch(sid) / f"pack-{len(data)}.erofs"
    blob.write_bytes(data)
    return blob


def test_stacks_share_files_and_outlive_each_other(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path)
    assert files.stack("sb-1") == [] and files.size("sb-1") == 0
    files.save("sb-1", "c1", [], _packed(files, "sb-1", b"a" * 100))
    c1 = files.stack("sb-1", "c1")
    assert [p.read_bytes() for p in c1] == [b"a" * 100]
    # a rollback to c1 puts its stack under the sandbox; c2 is taken on top of it
    files.save("sb-1", BASE, c1, None)
    files.save("sb-1", "c2", files.stack("sb-1"), _packed(files, "sb-1", b"b" * 30))
    c2 = files.stack("sb-1", "c2")
    assert [p.read_bytes() for p in c2] == [b"a" * 100, b"b" * 30]
    assert c2[0].stat().st_ino == c1[0].stat().st_ino  # linked, not copied
    assert files.size("sb-1") == on_disk(c2)  # each file once
    files.remove("sb-1", "c1")
    assert files.stack("sb-1", "c1") == []
    assert [p.read_bytes() for p in files.stack("sb-1", "c2")] == [b"a" * 100, b"b" * 30]
    assert files.size("sb-1") == on_disk(c2)  # the base and c2 still hold both
    # no pack file is left where it was made
    assert not list(files.sandbox_dir("sb-1").glob("pack-*"))


def test_saving_again_replaces_whole(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path)
    files.save("sb-1", "c1", [], _packed(files, "sb-1", b"one"))
    files.save("sb-1", "c2", [], _packed(files, "sb-1", b"two"))
    files.save("sb-1", BASE, files.stack("sb-1", "c1"), None)
    files.save("sb-1", BASE, files.stack("sb-1", "c2"), None)
    assert [p.read_bytes() for p in files.stack("sb-1")] == [b"two"]
    assert sorted(p.name for p in files.sandbox_dir("sb-1").iterdir()) == [BASE, "c1", "c2"]


def test_a_stack_orders_layers_by_number(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path)
    layers = []
    for i in range(12):
        files.save("sb-1", f"c{i + 1}", layers, _packed(files, "sb-1", bytes([i]) * (i + 1)))
        layers = files.stack("sb-1", f"c{i + 1}")
    assert [p.read_bytes()[0] for p in layers] == list(range(12))


def test_sweep_removes_only_the_ended(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path)
    for sid in ("sb-live", "sb-gone"):
        files.save(sid, "c1", [], _packed(files, sid, b"x"))
    assert files.holding == {"sb-live", "sb-gone"}
    assert files.sweep({"sb-live"}) == 1
    assert files.holding == {"sb-live"}  # a sandbox's end schedules a removal only for these
    files.remove_all("sb-live")
    assert files.holding == set()
    files.save("sb-live", "c1", [], _packed(files, "sb-live", b"x"))
    assert files.stack("sb-live", "c1") and not files.sandbox_dir("sb-gone").exists()
    assert CheckpointFiles(tmp_path / "never").sweep(set()) == 0


def test_a_record_keeps_its_checkpoints() -> None:
    rec = SandboxRecord("sb-1", "container", "dsec/busybox", State.running, 0.0, 60.0, Limits())
    assert "checkpoints" not in rec.persisted()  # a record that never took one stores nothing new
    rec.checkpoints = [CheckpointRecord("c2", "start", 12.5, 4096, 0.01)]
    rec.checkpoints_taken = 2
    again = SandboxRecord("sb-1", "container", "dsec/busybox", State.running, 0.0, 60.0, Limits())
    again.restore(rec.persisted())
    assert again.checkpoints == rec.checkpoints and again.checkpoints_taken == 2
    assert again.runtime == {}
    # a damaged entry is dropped, not fatal
    broken = rec.persisted()
    broken["checkpoints"]["list"].append({"id": "c3", "at": "soon"})
    again.restore(broken)
    assert [c.id for c in again.checkpoints] == ["c2"]
