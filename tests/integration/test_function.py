"""The function kind against a real daemon: warm workers lent, reset, verified, replaced; one-shot runs.

Pool figures are read through ``client.pools()``; each test uses limits of its own (a memory size no
other test uses), so it has a pool, and counts, of its own.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsec

from .conftest import Daemon, shut_down, start_daemon

BUSYBOX = "dsec/busybox"
DEBIAN = "dsec/debian:12"


@pytest.fixture(scope="module")
def fdaemon() -> Iterator[Daemon]:
    state = Path(tempfile.mkdtemp(prefix="dsec-fn-"))
    d = start_daemon(state, "--function-idle-ttl", "2", "--function-pool", f"{BUSYBOX}=2")
    try:
        yield d
    finally:
        shut_down(d)


def pool(client: dsec.Client, memory_mib: int) -> dsec.PoolInfo:
    found = [p for p in client.pools() if f" {memory_mib}Mi/" in p.image]
    assert len(found) == 1, client.pools()
    return found[0]


def settle(client: dsec.Client, memory_mib: int, resets: int, timeout: float = 10.0) -> dsec.PoolInfo:
    """The pool once ``resets`` uses have come back (reset and verified, or rejected)."""
    deadline = time.monotonic() + timeout
    while True:
        p = pool(client, memory_mib)
        if p.resets + p.rejected >= resets or time.monotonic() > deadline:
            return p
        time.sleep(0.02)


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def host_has_process(marker: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            if marker.encode() in _cmdline(pid):
                return True
    return False


def test_consecutive_uses_of_one_worker_share_nothing(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    secs = 4_000_000 + time.monotonic_ns() % 1_000_000  # a sleep nothing else on the node runs
    marker = f"sleep {secs}"
    first = dsec.Sandbox.create(BUSYBOX, kind="function", memory="301Mi", env={"SECRET": marker}, client=client)
    res = first.exec(
        f"echo {secs} > /tmp/left; echo {secs} > /dev/shm/left; mkdir -p /tmp/d/e; "
        f"sleep {secs} & setsid sh -c '(sleep {secs} &)'; "
        "echo $SECRET"
    )
    assert res.stdout.strip() == marker
    first.files.write("/tmp/api-file", marker.encode())
    assert host_has_process(marker)
    first.kill()
    p = settle(client, 301, 1)
    assert (p.made, p.resets, p.rejected) == (1, 1, 0), p

    second = dsec.Sandbox.create(BUSYBOX, kind="function", memory="301Mi", client=client)
    assert pool(client, 301).hits == 1  # the same worker, lent again
    out = second.exec("ls -A /tmp /dev/shm; cat /tmp/left /dev/shm/left; echo env=$SECRET; ps -o args").stdout
    assert str(secs) not in out
    assert "env=\n" in out
    assert not host_has_process(marker)
    with pytest.raises(dsec.FileNotFoundInSandbox):
        second.files.read("/tmp/api-file")
    second.kill()


def test_writing_outside_the_scratch_directories_gets_the_worker_replaced(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    sb = dsec.Sandbox.create(BUSYBOX, kind="function", memory="302Mi", client=client)
    sb.exec("echo residue > /root/answer")
    sb.kill()
    p = settle(client, 302, 1)
    assert p.rejected == 1, p
    again = dsec.Sandbox.create(BUSYBOX, kind="function", memory="302Mi", client=client)
    assert again.exec("cat /root/answer").exit_code != 0
    again.kill()
    assert pool(client, 302).made == 2


def test_system_v_ipc_left_behind_gets_the_worker_replaced(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    sb = dsec.Sandbox.create(DEBIAN, kind="function", memory="303Mi", client=client)
    res = sb.exec("ipcmk -M 4096 && ipcs -m | grep -c 4096")
    assert res.exit_code == 0 and res.stdout.split()[-1] == "1", res
    sb.kill()
    p = settle(client, 303, 1)
    assert p.rejected == 1, p
    again = dsec.Sandbox.create(DEBIAN, kind="function", memory="303Mi", client=client)
    assert "4096" not in again.exec("ipcs -m").stdout
    again.kill()


@pytest.mark.parametrize(
    ("memory", "limits", "attack"),
    [
        (311, {"pids": 32}, "for i in $(seq 64); do sleep 1 & done; wait"),  # fork bomb: pid limit hit
        (312, {}, "head -c 419430400 /dev/zero | sort > /dev/null"),  # memory: OOM kill
        (313, {"disk": "16Mi"}, "dd if=/dev/zero of=/root/fill bs=1M count=64; sync"),  # disk fill
        (314, {}, "sleep 30"),  # killed by its timeout
    ],
    ids=["fork-bomb", "memory", "disk-fill", "timeout"],
)
def test_a_hostile_use_replaces_the_worker_and_the_next_caller_is_served(
    fdaemon: Daemon, memory: int, limits: dict[str, object], attack: str
) -> None:
    client = fdaemon.client()
    name = attack
    sb = dsec.Sandbox.create(BUSYBOX, kind="function", memory=f"{memory}Mi", client=client, **limits)  # type: ignore[arg-type]
    sb.exec(attack, timeout=3)
    sb.kill()
    p = settle(client, memory, 1)
    assert p.rejected == 1 and p.resets == 0, (name, p)
    nxt = client.run(BUSYBOX, "echo fine", limits={"memory": f"{memory}Mi", **limits})
    assert nxt.ok and nxt.stdout == "fine\n", nxt
    assert not nxt.warm  # a new worker: the hostile one was destroyed


def test_the_agent_cannot_be_killed_from_inside_and_a_dead_one_is_replaced(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    sb = dsec.Sandbox.create(BUSYBOX, kind="function", memory="320Mi", client=client)
    res = sb.exec("kill -9 1; kill -KILL -1; echo still")
    assert "still" in res.stdout or res.exit_code is None
    assert sb.exec("echo alive").stdout == "alive\n"  # init ignores its own namespace's signals
    sb.kill()
    assert settle(client, 320, 1).resets == 1
    # a worker whose agent died (from the host: a crash) fails verification, and is never lent
    sb = dsec.Sandbox.create(BUSYBOX, kind="function", memory="320Mi", client=client)
    marker = f"sleep {5_000_000 + time.monotonic_ns() % 1_000_000}"
    sb.exec(f"{marker} &")
    orphan = next(p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in _cmdline(p))
    # the orphan's parent is now its namespace's init: the worker's agent, seen from the host
    agent = int(
        next(
            line.split()[1]
            for line in Path(f"/proc/{orphan}/status").read_text().splitlines()
            if line.startswith("PPid:")
        )
    )
    os.kill(agent, signal.SIGKILL)
    sb.kill()
    assert settle(client, 320, 2).rejected == 1
    assert client.run(BUSYBOX, ["true"], limits={"memory": "320Mi"}).ok


def test_pools_grow_under_a_burst_and_shrink_when_idle(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    runs = [{"image": BUSYBOX, "command": "sleep 0.5", "limits": {"memory": "330Mi"}}] * 12
    results = client.run_many(runs, concurrency=6)
    assert all(isinstance(r, dsec.RunResult) and r.ok for r in results), results
    grown = pool(client, 330)
    assert grown.made >= 4, grown
    deadline = time.monotonic() + 20
    while pool(client, 330).workers > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    shrunk = pool(client, 330)
    assert shrunk.workers == 0 and shrunk.destroyed == grown.made, shrunk


def test_a_pool_configured_at_start_is_warm_and_stays_at_its_minimum(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    default = next(p for p in client.pools() if p.min_idle == 2)
    assert default.image.startswith("dsec/busybox")
    deadline = time.monotonic() + 20
    while default.idle < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        default = next(p for p in client.pools() if p.min_idle == 2)
    assert default.idle == 2, default
    res = client.run(BUSYBOX, ["true"])
    assert res.ok and res.warm
    time.sleep(3)  # past the idle time to live: the minimum stays
    assert next(p for p in client.pools() if p.min_idle == 2).workers >= 2


def test_one_shot_runs_take_stdin_files_code_timeouts_and_huge_output(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    res = dsec.run(
        BUSYBOX,
        "cat; cat data.txt; od -An -tx1 bin.dat",
        stdin="IN:",
        client=client,
        files={"data.txt": "DATA", "bin.dat": b"\x00\xff", "/tmp/abs/x": "y"},
    )
    assert res.ok and res.stdout.startswith("IN:DATA") and "00 ff" in res.stdout, res
    res = client.run(DEBIAN, code="import sys\nprint(sys.stdin.read().upper())", stdin="hello")
    assert res.ok and res.stdout == "HELLO\n", res
    res = client.run(BUSYBOX, code="echo $0; exit 3", language="sh")
    assert res.exit_code == 3 and res.stdout == "/tmp/main.sh\n"
    res = client.run(BUSYBOX, "sleep 20", timeout=1)
    assert res.timed_out and res.exit_code != 0 and res.duration < 5
    res = client.run(BUSYBOX, "yes | head -c 5000000", output_limit=4096)
    assert res.ok and res.truncated and res.stdout_bytes == 5_000_000 and len(res.stdout) <= 8192
    with pytest.raises(dsec.InvalidRequest, match="exactly one of command and code"):
        client.run(BUSYBOX, "true", code="print(1)")
    with pytest.raises(dsec.InvalidRequest):
        client.run(BUSYBOX, "true", files={"../escape": "x"})
    with pytest.raises(dsec.ImageNotFound):
        client.run("nobody/nothing:1", "true")
    mixed = client.run_many([{"image": BUSYBOX, "command": "echo a"}, {"image": "nobody/nothing:1", "command": "x"}])
    assert isinstance(mixed[0], dsec.RunResult) and mixed[0].stdout == "a\n"
    assert isinstance(mixed[1], dsec.ImageNotFound)


def test_pools_and_metrics_are_visible(fdaemon: Daemon) -> None:
    client = fdaemon.client()
    client.run(BUSYBOX, ["true"], limits={"memory": "340Mi"})
    with httpx.Client(transport=httpx.HTTPTransport(uds=fdaemon.url.removeprefix("unix://"))) as http:
        reply = http.get("http://dsec/v1/metrics", headers={"Authorization": f"Bearer {fdaemon.token}"})
    assert reply.status_code == 200
    misses = {
        (sample.labels["tenant"], sample.labels["pool"]): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
        if sample.name == "dsec_pool_misses_total"
    }
    assert misses[("admin", "dsec/busybox:latest 340Mi/0.25cpu")] == 1


def test_a_tenant_at_its_worker_limit_waits_instead_of_failing() -> None:
    d = start_daemon(Path(tempfile.mkdtemp(prefix="dsec-fn-")), "--function-tenant-max", "1")
    try:
        client = d.client()
        results: list[dsec.RunResult] = []
        started = time.monotonic()
        threads = [threading.Thread(target=lambda: results.append(client.run(BUSYBOX, "sleep 1"))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 2 and all(r.ok for r in results)
        assert time.monotonic() - started >= 1.9  # one after the other, on the one worker
        p = client.pools()[0]
        assert (p.made, p.waited) == (1, 1), p
    finally:
        shut_down(d)


def test_a_restarted_daemon_keeps_a_lent_worker_serving_and_removes_idle_ones() -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-fn-"))
    d = start_daemon(state)
    lent = dsec.Sandbox.create(BUSYBOX, kind="function", client=d.client())
    idle = dsec.Sandbox.create(BUSYBOX, kind="function", memory="350Mi", client=d.client())
    idle.kill()  # its worker goes back to a pool the next daemon will not have
    time.sleep(0.5)
    assert len(list((state / "sandboxes").glob("fw-*"))) == 2
    d.stop(signal.SIGKILL)
    d = start_daemon(state)
    try:
        again = dsec.Sandbox.connect(lent.id, client=d.client())
        assert again.exec("echo back").stdout == "back\n"
        deadline = time.monotonic() + 10
        while len(list((state / "sandboxes").glob("fw-*"))) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list((state / "sandboxes").glob("fw-*"))) == 1  # the idle one is gone
        again.kill()
        deadline = time.monotonic() + 10
        while list((state / "sandboxes").glob("fw-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list((state / "sandboxes").glob("fw-*"))  # re-adopted workers are not pooled again
    finally:
        shut_down(d)
