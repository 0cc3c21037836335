"""Hostile workloads in one sandbox while a neighbour keeps answering."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dsec


@contextmanager
def heartbeat(neighbour: dsec.Sandbox) -> Iterator[list[float]]:
    """Exec round trips in the neighbour for as long as the block runs."""
    latencies: list[float] = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            t = time.monotonic()
            assert neighbour.exec(["true"], timeout=30).exit_code == 0
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(60)


def test_memory_bomb_is_oom_killed_and_reported(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    bomb = make_sandbox(memory="64Mi")
    neighbour = make_sandbox()
    with heartbeat(neighbour) as beats:
        # a shell variable grown without bound: busybox has no python
        res = bomb.exec("x=a; while true; do x=$x$x; done", timeout=60)
    assert res.oom_killed
    assert res.exit_code == 137 and not res.timed_out
    assert beats, "the neighbour never answered"
    assert bomb.exec("echo alive").stdout == "alive\n"  # the sandbox itself survives its step


def test_a_child_killed_by_the_oom_killer_under_a_shell_is_reported(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    """The README's case: a string command runs under /bin/sh -c, the shell waits for python, the OOM
    killer kills python and the shell exits 137. Before, only a command that itself died of SIGKILL was
    checked against the OOM counter, so this read oom_killed=False on cgroup v1 and v2 alike."""
    sb = make_sandbox(image="dsec/debian:12", memory="64Mi")
    res = sb.exec("python3 -c 'x = bytearray(200 << 20)'; exit $?", timeout=60)
    assert res.exit_code == 137 and res.signal is None and res.oom_killed, res
    calm = sb.exec("sh -c 'exit 137'")  # the same code without an OOM kill is not one
    assert calm.exit_code == 137 and not calm.oom_killed


def test_fork_bomb_is_contained(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    bomb = make_sandbox(pids=64)
    neighbour = make_sandbox()
    with heartbeat(neighbour) as beats:
        res = bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=4)
    assert res.timed_out
    assert beats and max(beats) < 10
    # after the step's tree is killed the sandbox works again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if bomb.exec("echo ok", timeout=10).stdout == "ok\n":
            break
        time.sleep(0.5)
    assert bomb.exec("echo ok").stdout == "ok\n"


def test_cpu_spin_does_not_starve_neighbour(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    spinner = make_sandbox(cpu=0.5, cpu_limit=1.0)
    neighbour = make_sandbox(cpu=1.0)
    with heartbeat(neighbour) as beats:
        res = spinner.exec("for i in 1 2 3 4; do (while :; do :; done) & done; sleep 3", timeout=3)
    assert res.timed_out
    assert len(beats) >= 3
    assert sorted(beats)[len(beats) // 2] < 1.0


def test_shm_fill_is_bounded(sb: dsec.Sandbox) -> None:
    res = sb.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=512", timeout=60)
    assert res.exit_code != 0
    assert "No space left" in res.stderr
