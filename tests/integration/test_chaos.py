"""Chaos (dsec bench chaos): each fault injected into a node of its own during a burst of 64 creations
and execs: every request ends with a result or a clear error, the node recovers (a killed daemon's
successor re-adopts what survived), SQLite and the layer repository are intact, and nothing leaks."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench.chaos import Case, run_case, seed, summary, verdict
from dsec_bench.faults import FAULTS

from .conftest import IMAGES_DIR

ROWS: list[dict[str, object]] = []


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-chaos-"))
    path.chmod(0o711)  # sandboxes' users traverse it to their bundles
    seed(IMAGES_DIR / "repository", path / "repository")
    yield path
    print("\n" + "\n".join(summary([r for r in ROWS if "requests" in r])))  # type: ignore[misc]
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_during_a_burst_is_survived(fault: str, root: Path) -> None:
    row = asyncio.run(run_case(Console(), Case.of(fault), root, root / "repository"))
    ROWS.append(row)
    print(f"\n[chaos] {fault}: {row['done']}; requests {row['requests']}; recovery {row['recovery']}")
    print("[chaos] errors:", row["requests"]["examples"], "phases:", row["phases"])
    if row["leaks"]:
        print("[chaos] not back to the baseline:", [r for r in row["diff"] if r["counter"] in row["leaks"]])
    assert verdict(row) == []
    assert row["requests"]["ok"] > 0  # the burst ran
