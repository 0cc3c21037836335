"""Output floods cost the daemon bounded memory: a 2 GB line without a newline, streamed (container kind:
VM kinds carry output through the same capped buffers, and under TCG here 2 GB through a guest would
take many minutes). Plus the VM console's cap. The unstreamed 2 GB line and both streams at once, with
the daemon's memory checked, are red-team cases for every kind (tests/security/test_resources.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, require_kind

GiB = 1 << 30
# what the daemon may grow by while 2 GB pass through it: the kept head and tail (1 MiB per stream by
# default), read chunks, JSON events; a daemon that buffered the output would grow by gigabytes
GROWTH_BOUND = 200 << 20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextmanager
def peak_rss(pid: int) -> Iterator[Callable[[], int]]:
    """Samples the daemon's resident memory every 20 ms; yields a function giving the growth's peak."""
    base = _rss(pid)
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss(pid))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield lambda: peak[0] - base
    finally:
        done.set()
        t.join()


@pytest.fixture(scope="module")
def flood_box(daemon: Daemon) -> Iterator[dsec.Sandbox]:
    sb = dsec.Sandbox.create(image="dsec/busybox", client=daemon.client(), timeout=1800)
    sb.exec("true")  # warm: the first exec's one-off allocations are not the flood's
    yield sb
    sb.kill()


LINE = "head -c 2147483648 /dev/zero | tr '\\0' a"


def test_a_2gb_line_streamed_costs_bounded_memory(flood_box: dsec.Sandbox, daemon: Daemon) -> None:
    received = 0
    final = None
    with peak_rss(daemon.proc.pid) as growth:
        for event in flood_box.exec_stream(LINE, timeout=600):
            if event.type == "stdout" and event.data:
                received += len(event.data)
            elif event.type == "result":
                final = event.result
    assert final is not None and final.stdout_bytes == 2 * GiB and final.truncated
    assert received <= 1 << 20  # events stop at output_limit; the result still counts every byte
    print(f"\n[dsec] 2 GiB line, streamed: daemon RSS grew by {growth() >> 20} MiB")
    assert growth() < GROWTH_BOUND


@pytest.mark.parametrize("kind", ["microvm"])
def test_a_console_flood_is_capped_on_disk(kind: str, daemon: Daemon) -> None:
    require_kind(daemon.client(), kind)
    sb = dsec.Sandbox.create(image="dsec/busybox", kind=kind, client=daemon.client(), memory="256Mi")
    try:
        # the guest's serial console, written as fast as the guest can: ~tens of MB under TCG in 20 s
        res = sb.exec(
            ["/.dsec/busybox", "sh", "-c", "yes 'console flood 0123456789' > /dev/console"],
            user="root",
            timeout=20,
        )
        assert res.timed_out
        bundle = daemon.state_dir / "vms" / sb.id
        logs = [p for p in bundle.iterdir() if p.name.startswith(("console.log", "qemu.log"))]
        sizes = {p.name: p.stat().st_size for p in logs}
        print(f"\n[dsec] console flood: log files {sizes}")
        assert sizes.get("console.log.1", 0) > 0, sizes  # the flood was bigger than one file's cap
        assert all(size <= 1 << 20 for size in sizes.values()), sizes
        assert sb.exec("echo alive").stdout == "alive\n"
    finally:
        sb.kill()
