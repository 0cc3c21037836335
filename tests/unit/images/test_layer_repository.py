from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.images.repository import LocalRepository, ThrottledRepository, open_repository

from ...repo_contract import check_chunks, check_objects


async def test_local_objects(tmp_path: Path) -> None:
    await check_objects(LocalRepository(tmp_path / "repo"))


async def test_local_chunks(tmp_path: Path) -> None:
    await check_chunks(LocalRepository(tmp_path / "repo"))


async def test_local_writes_are_atomic_and_leave_no_temporaries(tmp_path: Path) -> None:
    repo = LocalRepository(tmp_path / "repo")
    await repo.put("k", b"v" * 1000)
    assert [p.name for p in (tmp_path / "repo").iterdir()] == ["k"]
    assert await repo.list() == ["k"]


async def test_throttled_repository_keeps_the_contract(tmp_path: Path) -> None:
    repo = open_repository(f"throttle:0:1000:{tmp_path / 'repo'}")
    assert isinstance(repo, ThrottledRepository)
    await check_objects(repo)


async def test_throttled_repository_charges_latency_and_shares_bandwidth(tmp_path: Path) -> None:
    inner = LocalRepository(tmp_path / "repo")
    for i in range(4):
        await inner.put(f"k{i}", b"x" * 100_000)
    repo = ThrottledRepository(inner, latency_s=0.02, bytes_per_s=2_000_000)
    started = time.monotonic()
    await asyncio.gather(*(repo.get(f"k{i}") for i in range(4)))
    # four 100 kB reads share one 2 MB/s link: at least 0.2 s, however concurrent
    assert time.monotonic() - started >= 0.02 + 4 * 0.05 - 0.005
    assert repo.requests == 4 and repo.bytes == 400_000


@pytest.mark.parametrize("spec", ["throttle:x:1:/tmp", "throttle:1:0:/tmp", "throttle:1", "ftp://host/x"])
def test_bad_repository_specs(spec: str) -> None:
    with pytest.raises(InvalidRequest):
        open_repository(spec)
