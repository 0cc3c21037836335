"""The live feed of a sandbox's commands: watchers get start, output and end in order; nobody watching
costs nothing; a slow watcher loses events and is told how many, without blocking the command."""

from __future__ import annotations

import asyncio

import pytest

from dsec.core import exec_feed
from dsec.core.exec_feed import ExecFeed

pytestmark = pytest.mark.timeout(10)


async def test_a_watcher_sees_each_exec_in_order_and_only_its_sandboxes() -> None:
    feed = ExecFeed()
    assert not feed.watching("sb-1")
    with feed.watch("sb-1") as w:
        assert feed.watching("sb-1") and not feed.watching("sb-2")
        n = feed.started("sb-1", ["echo", "<b>hi</b>"])
        feed.output("sb-2", 99, "stdout", b"not mine")
        feed.output("sb-1", n, "stdout", b"hi\xff\n")
        feed.ended("sb-1", n, 3)
        events = [await asyncio.wait_for(w.next(), 1) for _ in range(3)]
    assert [e.kind for e in events] == ["start", "output", "end"]
    assert events[0].cmd == "echo <b>hi</b>" and events[0].exec == n
    assert events[1].data == "hi\ufffd\n" and events[1].stream == "stdout"  # bytes that are not UTF-8: replaced
    assert events[2].exit_code == 3
    assert not feed.watching("sb-1")  # the last watcher gone: the sandbox's execs are not tapped any more


async def test_a_slow_watcher_loses_events_and_is_told_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exec_feed, "MAX_QUEUED", 3)
    feed = ExecFeed()
    with feed.watch("sb-1") as w:
        n = feed.started("sb-1", "yes")
        for _ in range(10):
            feed.output("sb-1", n, "stdout", b"y\n")  # never blocks, never raises
        kinds = [(await w.next()).kind for _ in range(4)]
    assert kinds == ["start", "output", "output", "lost"]
    assert w.dropped == 0


async def test_two_watchers_each_get_everything() -> None:
    feed = ExecFeed()
    with feed.watch("sb-1") as a, feed.watch("sb-1") as b:
        feed.started("sb-1", "true")
        assert (await a.next()).kind == (await b.next()).kind == "start"
    assert not feed.watching("sb-1")


def test_a_huge_chunk_is_cut_for_the_feed() -> None:
    feed = ExecFeed()
    with feed.watch("sb-1") as w:
        feed.output("sb-1", 1, "stdout", b"x" * (exec_feed.MAX_DATA * 2))
        event = w.queue.get_nowait()
    assert event.data is not None and len(event.data) == exec_feed.MAX_DATA
