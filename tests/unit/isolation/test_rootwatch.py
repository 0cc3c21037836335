"""Exact change events of a directory under a root, from real inotify on a scratch directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dsec.errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from dsec.isolation import inotify, rootwatch
from dsec.isolation.rootpath import RootFS
from dsec.isolation.rootwatch import RootWatch


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "w").mkdir(parents=True)
    return r


async def _events(watch: RootWatch) -> list[tuple[str, str]]:
    await watch.wait(2.0)
    # the loop reads the kernel's queue when it is readable: give it a turn after the last change
    out: list[tuple[str, str]] = list(watch.take())
    for _ in range(5):
        await watch.wait(0.05)
        out += watch.take()
    return out


async def test_changes_are_reported_exactly_and_in_order(root: Path) -> None:
    hub = inotify.Hub()
    watch = RootWatch(hub, RootFS(str(root)), "/w", recursive=False)
    watch.start()
    try:
        w = root / "w"
        (w / "a.txt").write_text("1")
        os.chmod(w / "a.txt", 0o600)
        os.rename(w / "a.txt", w / "b.txt")
        (w / "gone").write_text("")
        (w / "gone").unlink()  # made and removed at once: a look would never see it
        (w / "b.txt").unlink()
        events = await _events(watch)
        assert events == [
            ("create", "a.txt"),
            ("write", "a.txt"),
            ("chmod", "a.txt"),
            ("rename", "a.txt"),
            ("create", "b.txt"),
            ("create", "gone"),
            ("remove", "gone"),
            ("remove", "b.txt"),
        ]
        (w / "sub").mkdir()
        (w / "sub" / "deep").write_text("not watched: the watch is not recursive")
        assert await _events(watch) == [("create", "sub")]
    finally:
        watch.close()
        hub.close()


async def test_a_recursive_watch_follows_new_directories_and_reports_what_they_held(root: Path) -> None:
    hub = inotify.Hub()
    (root / "w" / "old").mkdir()
    watch = RootWatch(hub, RootFS(str(root)), "/w", recursive=True)
    watch.start()
    try:
        (root / "w" / "old" / "x").write_text("x")
        staged = root / "staged"
        (staged / "inner").mkdir(parents=True)
        (staged / "inner" / "f").write_text("made before it was watched")
        os.rename(staged, root / "w" / "moved")
        events = await _events(watch)
        assert events[:2] == [("create", "old/x"), ("write", "old/x")]
        assert {("create", "moved"), ("create", "moved/inner"), ("create", "moved/inner/f")} <= set(events)
        assert ("write", "moved/inner/f") in events
        (root / "w" / "moved" / "inner" / "g").write_text("g")
        assert ("create", "moved/inner/g") in await _events(watch)
        # a directory moved out of the tree is no longer watched under its old name
        os.rename(root / "w" / "moved", root / "elsewhere")
        assert ("rename", "moved") in await _events(watch)
        (root / "elsewhere" / "inner" / "h").write_text("h")
        assert await _events(watch) == []
        shutil.rmtree(root / "w" / "old")
        assert {("remove", "old/x"), ("remove", "old")} <= set(await _events(watch))
    finally:
        watch.close()
        hub.close()


async def test_watches_are_confined_to_the_root_and_bounded(root: Path, tmp_path: Path) -> None:
    hub = inotify.Hub()
    fs = RootFS(str(root))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), root / "w" / "out")  # names a host directory; in the root, nothing
    try:
        with pytest.raises(FileNotFoundInSandbox):
            RootWatch(hub, fs, "/w/out", recursive=False).start()
        (root / "w" / "file").write_text("")
        with pytest.raises(InvalidRequest, match="not a directory"):
            RootWatch(hub, fs, "/w/file", recursive=False).start()
        for n in range(3):
            (root / "w" / f"d{n}").mkdir()
        old = rootwatch.MAX_DIRS
        rootwatch.MAX_DIRS = 3
        try:
            with pytest.raises(LimitExceeded):
                RootWatch(hub, fs, "/w", recursive=True).start()
        finally:
            rootwatch.MAX_DIRS = old
        ok = RootWatch(hub, fs, "/w", recursive=True)
        ok.start()
        (outside / "x").write_text("the host's, not the sandbox's")
        assert await _events(ok) == []
        ok.close()
    finally:
        hub.close()


async def test_two_watches_of_one_directory_share_its_inotify_watch(root: Path) -> None:
    hub = inotify.Hub()
    fs = RootFS(str(root))
    first = RootWatch(hub, fs, "/w", recursive=False)
    second = RootWatch(hub, fs, "/", recursive=True)
    first.start()
    second.start()
    try:
        (root / "w" / "a").write_text("")
        assert ("create", "a") in await _events(first)
        assert ("create", "w/a") in await _events(second)
        first.close()  # the other keeps the directory's watch
        (root / "w" / "b").write_text("")
        assert ("create", "w/b") in await _events(second)
        assert _inotify_fds() == 1
    finally:
        second.close()
    assert _inotify_fds() == 0  # nothing watched: the daemon holds no inotify descriptor
    again = RootWatch(hub, fs, "/w", recursive=False)
    again.start()
    (root / "w" / "c").write_text("")
    assert ("create", "c") in await _events(again)
    again.close()
    assert _inotify_fds() == 0


def _inotify_fds() -> int:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return links.count("anon_inode:inotify")


async def test_a_directory_moved_in_is_looked_at_within_a_bound(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootwatch, "MAX_SCAN", 5)
    hub = inotify.Hub()
    watch = RootWatch(hub, RootFS(str(root)), "/w", recursive=True)
    watch.start()
    try:
        staged = root / "many"
        staged.mkdir()
        for n in range(20):
            (staged / f"f{n:02}").write_text("")
        os.rename(staged, root / "w" / "many")
        events = await _events(watch)
        assert events[0] == ("create", "many")
        assert len([e for e in events if e[1].startswith("many/")]) == 5 and watch.lost
    finally:
        watch.close()
        hub.close()
