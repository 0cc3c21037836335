"""Child processes through libc's posix_spawn: fds placed by number, the environment, errors."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from dsec.proc import run, spawn


def test_fds_are_placed_by_number_and_the_rest_closed() -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    other = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    pid = spawn(["/bin/sh", "-c", f"echo five >&5; [ -e /proc/self/fd/{other} ] && echo leaked >&5"], {5: w})
    os.close(w)
    try:
        assert os.read(r, 100) == b"five\n"
    finally:
        os.waitpid(pid, 0)
        os.close(r)
        os.close(other)


def test_the_environment_is_ours_unless_given() -> None:
    os.environ["DSEC_PROC_TEST"] = "set-after-start"
    try:
        status, out = asyncio.run(run(["/bin/sh", "-c", "echo $DSEC_PROC_TEST"]))
        assert (status, out) == (0, b"set-after-start\n")
    finally:
        del os.environ["DSEC_PROC_TEST"]
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = spawn(["/usr/bin/env"], {1: w}, env={"ONLY": "this"})
    os.close(w)
    assert os.read(r, 1000) == b"ONLY=this\n"
    os.waitpid(pid, 0)
    os.close(r)


def test_a_missing_program_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        spawn(["/nonexistent/program"], {})


def test_other_threads_run_while_a_child_starts() -> None:
    """The GIL is let go during posix_spawn: a Python thread keeps counting through a burst of spawns."""
    counted, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        pids = [spawn(["/bin/true"], {}) for _ in range(50)]
    finally:
        stop.set()
        t.join()
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert counted[0] > 0


def test_run_can_start_the_child_elsewhere() -> None:
    started = []

    async def start(argv: list[str], fds: dict[int, int]) -> int:
        started.append(argv)
        return spawn(argv, fds)

    status, out = asyncio.run(run(["/bin/echo", "hi"], start=start))  # type: ignore[arg-type]
    assert (status, out, started) == (0, b"hi\n", [["/bin/echo", "hi"]])
    t0 = time.monotonic()
    status, _ = asyncio.run(run(["/bin/sleep", "5"], timeout=0.2))
    assert status == -9 and time.monotonic() - t0 < 3
