"""MemoryScratch: a pulled layer is packed in /dev/shm when it fits, on disk otherwise, and nothing a killed
daemon left there outlives the next start."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.images import scratch
from dsec.images.scratch import MAX_IN_MEMORY, MemoryScratch

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this host")


def test_a_layer_that_fits_goes_to_memory_and_is_gone_after_close(tmp_path: Path) -> None:
    s = MemoryScratch(tmp_path / "node")
    where = s.place(1 << 20)
    assert where is not None and where.parent == Path("/dev/shm") and where.is_dir()
    (where / "pack.erofs").write_bytes(b"x")
    s.close()
    assert not where.exists()


def test_too_big_or_too_little_memory_means_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = MemoryScratch(tmp_path / "node")
    assert s.place(MAX_IN_MEMORY + 1) is None
    monkeypatch.setattr(scratch, "_available", lambda: 3 << 20)  # a host with 3 MiB available
    assert s.place(1 << 20) is None
    s.close()


def test_not_a_tmpfs_means_the_disk(tmp_path: Path) -> None:
    s = MemoryScratch(tmp_path / "node", shm=tmp_path)  # a directory, not a tmpfs mount
    assert s.dir is None and s.place(1) is None


def test_what_a_killed_daemon_left_is_removed_at_the_next_start(tmp_path: Path) -> None:
    first = MemoryScratch(tmp_path / "node")
    where = first.place(1)
    assert where is not None
    (where / "pack-left.erofs").write_bytes(b"left by a daemon killed mid-pull")
    second = MemoryScratch(tmp_path / "node")  # the same node's next daemon
    assert not where.exists()
    other = MemoryScratch(tmp_path / "other-node")
    assert other.dir != second.dir  # two nodes on one host keep apart
    second.close()
    other.close()
