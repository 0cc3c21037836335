"""Pruning the node's VM templates: other guest assets go at once, then least recently used over budget."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dsec.kinds.microvm import templates

ASSETS = ["vmlinuz-6.12", "initrd-aaaa.gz", "helper-aaaa.erofs"]


def _template(root: Path, key: str, size: int, used_ago: float, assets: list[str] = ASSETS) -> None:
    (root / key).mkdir(parents=True)
    (root / key / templates.MEMORY).write_bytes(b"m" * size)
    templates.record(root, key, assets, ("layer-1",))
    at = time.time() - used_ago
    os.utime(root / key / templates.MEMORY, (at, at))


def test_prune_keeps_the_budget_least_recently_used_first(tmp_path: Path) -> None:
    _template(tmp_path, "old", 400, used_ago=300)
    _template(tmp_path, "mid", 400, used_ago=200)
    _template(tmp_path, "new", 400, used_ago=100)
    assert templates.prune(tmp_path, ASSETS, budget=1000) == ["old"]
    templates.used(tmp_path, "mid")  # a restore: now the most recent
    assert templates.prune(tmp_path, ASSETS, budget=500) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid"]


def test_prune_drops_templates_of_other_guest_assets_and_keeps_what_is_in_use(tmp_path: Path) -> None:
    _template(tmp_path, "stale", 10, used_ago=1, assets=["vmlinuz-6.1", "initrd-bbbb.gz", "helper-bbbb.erofs"])
    _template(tmp_path, "current", 10, used_ago=1)
    _template(tmp_path, "building", 10_000, used_ago=1)
    removed = templates.prune(tmp_path, ASSETS, budget=100, keep=frozenset({"building"}))
    assert removed == ["stale"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["building", "current"]


def test_prune_removes_old_half_saved_templates_only(tmp_path: Path) -> None:
    (tmp_path / "fresh-partial").mkdir()
    (tmp_path / "old-partial").mkdir()
    an_hour_ago = time.time() - 7200
    os.utime(tmp_path / "old-partial", (an_hour_ago, an_hour_ago))
    assert templates.prune(tmp_path, ASSETS) == ["old-partial"]
    assert templates.prune(tmp_path / "missing", ASSETS) == []
