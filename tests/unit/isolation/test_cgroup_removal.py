"""Removing a sandbox's cgroup tree while its exec groups remove themselves (the soak's kill during an
exec): a child group that vanishes mid-walk is removed, not an error that leaks the rest of the sandbox."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.isolation import cgroups


def _tree(root: Path) -> Path:
    group = root / "sb-1"
    for sub in ("exec-a/inner", "exec-b", "exec-c"):
        (group / sub).mkdir(parents=True)
    (group / "cgroup.procs").write_text("")
    return group


@pytest.mark.timeout(10)
def test_a_child_group_that_vanishes_during_the_walk_counts_as_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = _tree(tmp_path)
    (group / "cgroup.procs").unlink()  # plain directories stand in for cgroupfs, where rmdir ignores files
    real_walk = os.walk

    def racing_walk(top: object, *args: object, **kwargs: object) -> Iterator[tuple[str, list[str], list[str]]]:
        for parent, dirs, files in real_walk(top, *args, **kwargs):  # type: ignore[call-overload]
            if "exec-b" in dirs:
                (Path(parent) / "exec-b").rmdir()  # the exec ends and removes its own group meanwhile
            yield parent, dirs, files

    monkeypatch.setattr(cgroups.os, "walk", racing_walk)
    assert cgroups.remove_group(group) is True
    assert not group.exists()


@pytest.mark.timeout(10)
def test_a_group_that_still_holds_something_is_reported_and_kept(tmp_path: Path) -> None:
    group = _tree(tmp_path)
    (group / "exec-c" / "busy").write_text("x")  # rmdir fails on it as on a group with live processes
    assert cgroups.remove_group(group) is False
    assert (group / "exec-c").exists() and not (group / "exec-a").exists()


@pytest.mark.timeout(10)
def test_group_pids_reads_every_level_and_skips_a_vanished_child(tmp_path: Path) -> None:
    group = _tree(tmp_path)
    (group / "cgroup.procs").write_text("10\n")
    (group / "exec-a" / "inner" / "cgroup.procs").write_text("11\n12\n")
    (group / "exec-b" / "cgroup.procs").write_text("garbage\n")
    assert sorted(cgroups.group_pids(group)) == [10, 11, 12]
    assert cgroups.group_pids(tmp_path / "gone") == []
