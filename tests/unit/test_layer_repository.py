from __future__ import annotations

from pathlib import Path

from dsec.images.repository import LocalRepository

from ..repo_contract import check_chunks, check_objects


async def test_local_objects(tmp_path: Path) -> None:
    await check_objects(LocalRepository(tmp_path / "repo"))


async def test_local_chunks(tmp_path: Path) -> None:
    await check_chunks(LocalRepository(tmp_path / "repo"))


async def test_local_writes_are_atomic_and_leave_no_temporaries(tmp_path: Path) -> None:
    repo = LocalRepository(tmp_path / "repo")
    await repo.put("k", b"v" * 1000)
    assert [p.name for p in (tmp_path / "repo").iterdir()] == ["k"]
    assert await repo.list() == ["k"]
