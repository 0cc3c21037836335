"""Where an exec's time goes: the median time between marks taken at each hop of ``exec(["true"])``, from
the SDK through the daemon and the sandbox's agent and back (docs/performance.md).

    PYTHONPATH=src python tools/exec_hops.py [N]     # as root, with busybox and crun, like `dsec bench lifecycle`

It starts a daemon as the bench does, with marks (CLOCK_MONOTONIC, which both processes share) hooked
into uvicorn, the API's middleware, the core, the container kind and the agent channel; the client marks
each call's start and end and when it reads the answer. Calls whose marks came in another order (the
answer's head and body read apart, say) are left out of the table: its header says how many were kept.
The marks cost some µs each, so the total is above what `dsec bench lifecycle` measures.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARKS: list[tuple[str, int]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.perf_counter_ns()))


def _around(cls: Any, name: str, before: str, after: str | None = None) -> None:
    real = getattr(cls, name)

    async def hooked(*args: Any, **kwargs: Any) -> Any:
        mark(before)
        result = await real(*args, **kwargs)
        if after is not None:
            mark(after)
        return result

    setattr(cls, name, hooked)


def hook_daemon(out: Path) -> None:
    from uvicorn.protocols.http import httptools_impl as h

    from dsec.core import actions
    from dsec.kinds.container import agent, backend, execution
    from dsec.server import port_proxy
    from dsec.web import limits

    received = h.HttpToolsProtocol.data_received

    def data_received(self: Any, data: bytes) -> None:
        mark("d.recv")
        received(self, data)

    h.HttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]
    sent = h.RequestResponseCycle.send

    async def send(self: Any, message: Any) -> None:
        last = message["type"] == "http.response.body" and not message.get("more_body")
        mark("d.body_send" if last else "d.start_send" if message["type"] == "http.response.start" else "d.send")
        await sent(self, message)
        if last:
            mark("d.sent")

    h.RequestResponseCycle.send = send  # type: ignore[method-assign]
    _around(port_proxy.PortProxy, "__call__", "d.asgi")
    _around(limits.BodyLimit, "__call__", "d.bodylimit")
    _around(actions.Actions, "call", "d.route", "d.route_done")
    _around(agent.AgentChannel, "_spawn_once", "d.spawn", "d.spawned")
    _around(execution._Capture, "finish", "d.finish", "d.finished")
    dispatch = agent.AgentChannel._dispatch

    def dispatched(self: Any, frame: bytes) -> None:
        mark("d.agent_" + chr(frame[0]))
        dispatch(self, frame)

    agent.AgentChannel._dispatch = dispatched  # type: ignore[method-assign]
    kind_call = "run_via_agent"  # the backend's own name for it, which the daemon calls
    run = getattr(backend, kind_call)

    async def run_via_agent(*args: Any, **kwargs: Any) -> Any:
        mark("d.kind")
        result = await run(*args, **kwargs)
        mark("d.kind_done")
        return result

    setattr(backend, kind_call, run_via_agent)

    def dump(*_: object) -> None:
        out.write_text(json.dumps(MARKS))
        MARKS.clear()

    signal.signal(signal.SIGUSR1, lambda *_: MARKS.clear())
    signal.signal(signal.SIGUSR2, dump)


def hook_client() -> None:
    from dsec.protocol import http1

    feed = http1.Answer.feed

    async def fed(self: Any, conn: Any, timeout: Any) -> None:
        await feed(self, conn, timeout)
        mark("c.read")

    http1.Answer.feed = fed  # type: ignore[method-assign]


def table(marks: list[tuple[str, int]]) -> None:
    calls: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] | None = None
    for name, t in sorted(marks, key=lambda m: m[1]):
        if name == "c.begin":
            current = [(name, t)]
        elif current is not None:
            current.append((name, t))
            if name == "c.end":
                calls.append(current)
                current = None
    orders: dict[tuple[str, ...], list[list[tuple[str, int]]]] = {}
    for call in calls:
        orders.setdefault(tuple(n for n, _ in call), []).append(call)
    order, kept = max(orders.items(), key=lambda kv: len(kv[1]))
    print(f"{len(kept)} of {len(calls)} calls had their marks in the most common order")
    for i in range(1, len(order)):
        gaps = [(c[i][1] - c[i - 1][1]) / 1e3 for c in kept]
        print(f"  {order[i - 1]:>14} -> {order[i]:<14} p50 {statistics.median(gaps):6.0f} µs")
    totals = [(c[-1][1] - c[0][1]) / 1e3 for c in kept]
    print(f"  total p50 {statistics.median(totals):.0f} µs")


def start_daemon(state: Path, out: Path, repository: Path) -> subprocess.Popen[bytes]:
    """A daemon as `dsec bench lifecycle` starts one, with the marks hooked in (this file, ``--serve``)."""
    argv = [sys.executable, __file__, "--serve", str(out), "serve", "--state-dir", str(state)]
    argv += ["--listen", f"unix://{state}/dsec.sock", "--repository", str(repository), "--log-level", "warning"]
    with (state / "daemon.log").open("ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)


async def measure(n: int) -> None:
    from dsec_bench.common import IMAGES_DIR, connect, release_node, stop_daemon

    state = Path(tempfile.mkdtemp(prefix="dsec-hops-", dir="/var/tmp"))
    out = state / "marks.json"
    proc = start_daemon(state, out, IMAGES_DIR / "repository")
    try:
        client = await connect(proc, state)
        await client.build_image("dsec/busybox")
        sb = await client.create(image="dsec/busybox")
        for _ in range(30):  # untimed: connections, caches
            await sb.exec(["true"])
        hook_client()
        os.kill(proc.pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)
        for _ in range(n):
            mark("c.begin")
            await sb.exec(["true"])
            mark("c.end")
        os.kill(proc.pid, signal.SIGUSR2)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if out.exists():
                break
        await sb.kill()
        await client.aclose()
    finally:
        stop_daemon(proc)
        release_node(state)
    table(MARKS + [(name, t) for name, t in json.loads(out.read_text())])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        hook_daemon(Path(sys.argv[2]))
        sys.argv = ["dsec", *sys.argv[3:]]
        runpy.run_module("dsec", run_name="__main__", alter_sys=True)
        return
    asyncio.run(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 500))


if __name__ == "__main__":
    main()
