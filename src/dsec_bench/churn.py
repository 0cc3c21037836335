"""The soak's churn: scenarios of create / exec / files / snapshot / fork / network / kill across the kinds,
hostile workloads among them, each checked for its safe outcome, every operation tallied.

The tally is bounded whatever the run's length: counts per (kind, operation), error counts per class
with a few examples each, hostile outcomes per (kind, workload).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dsec import AsyncClient, AsyncSandbox, DsecError, ExecResult, InvalidState

LABELS = {"dsec-bench": "soak"}
IMAGE = "dsec/busybox"
TTL = 600.0  # every sandbox's time to live: the node's reaper removes what a broken scenario left
EXAMPLES = 3  # messages kept per error class
CONTAINER_KINDS = ("container", "function")
VM_KINDS = ("microvm", "vm")
# limits of hostile sandboxes: small enough that bombs, hogs and fills reach them in seconds
HOSTILE: dict[str, Any] = {"memory": "128Mi", "pids": 64, "disk": "32Mi"}
VM_HOSTILE: dict[str, Any] = {"memory": "256Mi", "pids": 64}


class Unexpected(Exception):
    """A hostile workload's outcome, or an operation's result, was not the safe one."""


class Evicted(Exception):
    """The node evicted the scenario's sandbox under host memory pressure (its policy, not a fault: the
    host's memory is shared with whatever else runs there)."""


EVICTED = "evicted under memory pressure"


@dataclass
class Tally:
    ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    slowest: dict[tuple[str, str], float] = field(default_factory=dict)
    expected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    examples: dict[str, dict[str, list[str]]] = field(default_factory=lambda: {"expected": {}, "unexpected": {}})
    hostile: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    scenarios: Counter[tuple[str, str]] = field(default_factory=Counter)
    created: list[str] = field(default_factory=list)  # ids since the last drain (the caller empties it)

    def done(self, kind: str, op: str, seconds: float) -> None:
        self.ops[kind, op] += 1
        self.seconds[kind, op] = self.seconds.get((kind, op), 0.0) + seconds
        self.slowest[kind, op] = max(self.slowest.get((kind, op), 0.0), seconds)

    def error(self, cls: str, message: str, expected: bool) -> None:
        (self.expected if expected else self.unexpected)[cls] += 1
        kept = self.examples["expected" if expected else "unexpected"].setdefault(cls, [])
        if len(kept) < EXAMPLES:
            kept.append(message[:400])

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def report(self) -> dict[str, Any]:
        ops: dict[str, dict[str, Any]] = {}
        for (kind, op), n in sorted(self.ops.items()):
            mean = self.seconds[kind, op] / n
            ops.setdefault(kind, {})[op] = {
                "n": n,
                "mean_ms": round(mean * 1000, 1),
                "max_ms": round(1000 * self.slowest[kind, op], 1),
            }
        hostile: dict[str, dict[str, dict[str, int]]] = {}
        for (kind, work, outcome), n in sorted(self.hostile.items()):
            hostile.setdefault(kind, {}).setdefault(work, {})[outcome] = n
        return {
            "operations": ops,
            "operations_total": self.total_ops,
            "scenarios": {f"{k}/{s}": n for (k, s), n in sorted(self.scenarios.items())},
            "hostile": hostile,
            "errors": {
                "expected": dict(sorted(self.expected.items())),
                "unexpected": dict(sorted(self.unexpected.items())),
                "examples": {side: dict(sorted(kept.items())) for side, kept in self.examples.items()},
            },
        }


@dataclass
class Churn:
    client: AsyncClient
    tally: Tally
    snapshots: itertools.count[int] = field(default_factory=itertools.count)

    async def op(self, kind: str, name: str, step: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        result = await step
        self.tally.done(kind, name, time.perf_counter() - started)
        return result

    async def create(self, kind: str, image: str = IMAGE, **kwargs: Any) -> AsyncSandbox:
        sb: AsyncSandbox = await self.op(
            kind, "create", self.client.create(image=image, kind=kind, labels=LABELS, timeout=TTL, **kwargs)
        )
        self.tally.created.append(sb.id)
        return sb

    @contextlib.asynccontextmanager
    async def sandbox(self, kind: str, image: str = IMAGE, **kwargs: Any) -> AsyncIterator[AsyncSandbox]:
        """A sandbox killed on the way out, whatever happened inside."""
        sb = await self.create(kind, image, **kwargs)
        try:
            yield sb
        except Exception as e:
            with contextlib.suppress(DsecError):
                info = await sb.info()
                if info.reason and EVICTED in info.reason:
                    raise Evicted(f"{kind} {sb.id}: {info.reason}") from e
            raise
        finally:
            await self.op(kind, "kill", sb.kill())

    async def exec(self, kind: str, sb: AsyncSandbox, cmd: str, **kwargs: Any) -> ExecResult:
        res: ExecResult = await self.op(kind, "exec", sb.exec(cmd, **kwargs))
        return res

    async def echo(self, kind: str, sb: AsyncSandbox) -> None:
        res = await self.exec(kind, sb, "echo ok", timeout=30)
        if res.stdout != "ok\n":
            raise Unexpected(f"{kind} {sb.id}: echo gave {res.stdout[-200:]!r} {res.stderr[-200:]!r} ({res.exit_code})")

    # ---- scenarios ----------------------------------------------------------------------------------

    async def basic(self, kind: str) -> None:
        async with self.sandbox(kind) as sb:
            await self.echo(kind, sb)
            await self.files(kind, sb)
            events = [e async for e in sb.exec_stream("echo one; echo two >&2", timeout=30)]
            self.tally.done(kind, "exec_stream", 0.0)
            if events[-1].type != "result" or events[-1].result is None or events[-1].result.exit_code != 0:
                raise Unexpected(f"{kind} {sb.id}: streamed exec ended with {events[-1]!r}")

    async def files(self, kind: str, sb: AsyncSandbox) -> None:
        payload = secrets.token_bytes(4096)
        await self.op(kind, "files.mkdir", sb.files.mkdir("/tmp/soak"))
        await self.op(kind, "files.write", sb.files.write("/tmp/soak/blob", payload))
        if await self.op(kind, "files.read", sb.files.read("/tmp/soak/blob")) != payload:
            raise Unexpected(f"{kind} {sb.id}: a file read back differs from what was written")
        listing = await self.op(kind, "files.list", sb.files.list("/tmp/soak"))
        if [e.name for e in listing] != ["blob"]:
            raise Unexpected(f"{kind} {sb.id}: listing {[e.name for e in listing]}")
        await self.op(kind, "files.remove", sb.files.remove("/tmp/soak", recursive=True))

    async def snapshot(self, kind: str) -> None:
        """pack_diff: a container's change published as an image, a sandbox started from it, the image
        removed again (its layer goes at the next gc)."""
        name = f"soak/snap-{next(self.snapshots)}-{secrets.token_hex(3)}:v1"
        marker = secrets.token_hex(8)
        async with self.sandbox(kind) as sb:
            await self.op(kind, "files.write", sb.files.write("/work/marker", marker))
            await self.op(kind, "snapshot", sb.snapshot(name))
        try:
            async with self.sandbox(kind, image=name) as child:
                got = await self.op(kind, "files.read", child.files.read("/work/marker"))
                if got.decode() != marker:
                    raise Unexpected(f"{kind}: a sandbox of snapshot {name} reads {got[:40]!r}")
        finally:
            await self.op(kind, "image.remove", self.client.remove_image(name))

    async def fork(self, kind: str) -> None:
        marker = secrets.token_hex(8)
        async with self.sandbox(kind) as sb:
            await self.op(kind, "files.write", sb.files.write("/tmp/marker", marker))
            children = await self.op(kind, "fork", sb.fork(1))
            for child in children:
                try:
                    got = await self.op(kind, "files.read", child.files.read("/tmp/marker"))
                    if got.decode() != marker:
                        raise Unexpected(f"{kind}: fork {child.id} of {sb.id} reads {got[:40]!r}")
                finally:
                    await self.op(kind, "kill", child.kill())

    async def network(self, kind: str) -> None:
        async with self.sandbox(kind, network="full") as sb:
            await self.op(kind, "network.status", sb.network_status())
            await self.op(kind, "network.set", sb.set_network({"allow": ["10.1.2.0/24:443", "example.com:443"]}))
            await self.op(kind, "network.set", sb.set_network(None))
            await self.echo(kind, sb)

    async def pause(self, kind: str) -> None:
        async with self.sandbox(kind) as sb:
            await self.op(kind, "pause", sb.pause())
            await self.op(kind, "resume", sb.resume())
            await self.echo(kind, sb)

    async def expire(self, kind: str) -> None:
        """Left to the node's reaper: a sandbox whose time to live runs out is stopped and freed."""
        sb = await self.op(kind, "create", self.client.create(image=IMAGE, kind=kind, labels=LABELS, timeout=2))
        self.tally.created.append(sb.id)
        await self.echo(kind, sb)
        deadline = time.monotonic() + 30
        while (info := await sb.info()).state.value not in ("stopped", "failed", "lost"):
            if time.monotonic() > deadline:
                raise Unexpected(f"{kind} {sb.id}: still {info.state.value} 30 s after its time to live")
            await asyncio.sleep(0.5)
        self.tally.done(kind, "expired", 0.0)

    async def gc(self, kind: str) -> None:
        """The image gc while sandboxes come and go: removed snapshots' layers go, none in use does."""
        await self.op(kind, "image.gc", self.client.gc_images())

    async def kill_mid_exec(self, kind: str) -> None:
        """A sandbox killed while a command runs in it: the command's call ends (with the sandbox gone)."""
        sb = await self.create(kind)
        running = asyncio.ensure_future(sb.exec("sleep 120", timeout=150))
        await asyncio.sleep(0.5)
        await self.op(kind, "kill", sb.kill())
        try:
            res = await asyncio.wait_for(running, 60)
        except InvalidState as e:  # SandboxGone, or the call interrupted by the kill
            self.tally.error(type(e).__name__, f"{kind}: exec during kill: {e}", expected=True)
        except TimeoutError:
            raise Unexpected(f"{kind} {sb.id}: an exec still running 60 s after its sandbox was killed") from None
        else:
            if res.exit_code == 0:
                raise Unexpected(f"{kind} {sb.id}: `sleep 120` finished normally although its sandbox was killed")
        self.tally.done(kind, "kill_mid_exec", 0.0)

    async def hostile(self, kind: str, work: str) -> None:
        limits = VM_HOSTILE if kind in VM_KINDS else HOSTILE
        async with self.sandbox(kind, IMAGE, **limits) as sb:
            cmd, kwargs, check = WORKLOADS[work]
            res = await self.exec(kind, sb, cmd, **kwargs)
            verdict = check(res)
            self.tally.hostile[kind, work, "contained" if verdict is None else "NOT contained"] += 1
            if verdict is not None:
                raise Unexpected(f"{kind} {sb.id} {work}: {verdict}: {_brief(res)}")
            if work == "escape":
                left = await self.exec(kind, sb, "ps -o args", timeout=30)
                if ESCAPE_TAG in left.stdout:
                    raise Unexpected(f"{kind} {sb.id}: escapees outlived their command: {left.stdout[-400:]}")
            await self.echo(kind, sb)  # and the sandbox is usable again


def _brief(res: ExecResult) -> str:
    fields = ("exit_code", "signal", "timed_out", "oom_killed", "truncated", "stdout_bytes", "duration")
    return ", ".join(f"{f}={getattr(res, f)}" for f in fields) + f", stderr={res.stderr[-200:]!r}"


ESCAPE_TAG = "sleep 7391"  # a duration no other process uses


def _timed_out(res: ExecResult) -> str | None:
    return None if res.timed_out else "not killed at its timeout"


def _fork_bounded(res: ExecResult) -> str | None:
    # killed at its timeout, or the step's own shell lost the race for a pid and gave up: either way the
    # pids limit held the bomb (the exec's group, bomb included, is killed when the call ends)
    if res.timed_out or (res.exit_code not in (0, None) and "can't fork" in res.stderr):
        return None
    return "neither killed at its timeout nor refused a fork"


def _oom(res: ExecResult) -> str | None:
    return None if res.oom_killed and not res.timed_out else "not reported OOM-killed"


def _disk_full(res: ExecResult) -> str | None:
    return None if "No space left" in res.stderr and not res.timed_out else "the fill did not stop at the disk limit"


def _flood(res: ExecResult) -> str | None:
    if not res.truncated or len(res.stdout) > (64 << 10) + 4096:
        return "output not truncated at its limit"
    return None if res.timed_out else "not killed at its timeout"


def _escaped(res: ExecResult) -> str | None:
    return None if res.timed_out and res.duration < 30 else "not killed at its timeout"


Check = Callable[[ExecResult], str | None]
WORKLOADS: dict[str, tuple[str, dict[str, Any], Check]] = {
    # `exec sleep`: the step's own shell needs no new pid to wait out its timeout
    "fork_bomb": ("bomb() { bomb | bomb & }; bomb; exec sleep 20", {"timeout": 3}, _fork_bounded),
    "memory_hog": ("x=a; while true; do x=$x$x; done", {"timeout": 90}, _oom),
    # files of 8 MiB each: one file alone would meet the file-size limit (the disk limit by default) first
    "disk_fill": (
        'i=0; while out=$(dd if=/dev/zero of=/var/fill$i bs=1M count=8 2>&1); do i=$((i+1)); done; echo "$out" >&2',
        {"timeout": 90},
        _disk_full,
    ),
    "output_flood": ("yes soak", {"timeout": 2, "output_limit": 64 << 10}, _flood),
    "outlives_timeout": ("trap '' TERM INT HUP; sleep 60", {"timeout": 1}, _timed_out),
    "escape": (
        f"setsid {ESCAPE_TAG}1 & ( ({ESCAPE_TAG}2 &) & ); nohup {ESCAPE_TAG}3 >/dev/null 2>&1 & {ESCAPE_TAG}4",
        {"timeout": 1},
        _escaped,
    ),
}
# a VM's writable layer is a disk of its own; the fill is the container kinds' case
VM_WORKLOADS = tuple(w for w in WORKLOADS if w != "disk_fill")
