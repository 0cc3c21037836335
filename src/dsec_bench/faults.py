"""The chaos bench's burst and its faults: what runs on the node, and what is done to it meanwhile.

Every request of the burst is judged by how it ended: a result, a clear error (a ``DsecError`` that names
what happened), an unclear one (anything else, or the daemon's ``internal`` error), or no end within its
deadline (a hang). A fault waits for the burst to be under way, acts once, and says what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dsec import AsyncClient, AsyncSandbox, DsecError

T = TypeVar("T")
LABELS = {"dsec-bench": "chaos"}
REQUEST_DEADLINE = 180.0  # a request unanswered after this is a hang
EXAMPLES = 5
POLL = 0.002  # how often /proc is scanned for a crun mid-create


@dataclass
class Requests:
    ok: int = 0
    failed_commands: int = 0  # answered with the command's own failure (a non-zero exit, say)
    clear: Counter[str] = field(default_factory=Counter)  # error code -> count
    examples: dict[str, str] = field(default_factory=dict)  # error code -> the first message
    unclear: list[str] = field(default_factory=list)
    hung: int = 0
    created: list[str] = field(default_factory=list)

    async def one(self, what: str, work: Awaitable[T]) -> T | None:
        try:
            result = await asyncio.wait_for(work, REQUEST_DEADLINE)
        except TimeoutError:
            self.hung += 1
            return None
        except DsecError as e:
            if e.code == "internal" or not e.message:
                self._unclear(f"{what}: {e.code}: {e.message}")
            else:
                self.clear[e.code] += 1
                self.examples.setdefault(e.code, f"{what}: {e.message}"[:300])
            return None
        except Exception as e:  # a transport or SDK failure that is not an error of dsec's
            self._unclear(f"{what}: {type(e).__name__}: {e}")
            return None
        self.ok += 1
        return result

    def _unclear(self, text: str) -> None:
        if len(self.unclear) < EXAMPLES:
            self.unclear.append(text[:300])
        else:
            self.unclear[-1] = f"… and more ({text[:120]})"

    def report(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "failed_commands": self.failed_commands,
            "clear_errors": dict(sorted(self.clear.items())),
            "examples": dict(sorted(self.examples.items())),
            "unclear_errors": self.unclear,
            "hung": self.hung,
        }


@dataclass
class Burst:
    """``n`` lifecycles at once: create, exec, (every eighth) snapshot, kill."""

    client: AsyncClient
    requests: Requests
    image: str = "dsec/busybox"
    command: str = "echo ok"
    vms: int = 0  # how many of the lifecycles are microVMs
    started: asyncio.Event = field(default_factory=asyncio.Event)  # the first creation is done
    vm_up: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    hold: asyncio.Event = field(default_factory=asyncio.Event)  # VMs wait for it before their exec
    created: int = 0
    problems: list[str] = field(default_factory=list)  # what a fault found wrong in its own outcome
    _progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def run(self, n: int) -> None:
        await asyncio.gather(*(self._lifecycle(i) for i in range(n)))

    async def _lifecycle(self, i: int) -> None:
        vm = i < self.vms
        kind = "microvm" if vm else "container"
        req = self.requests
        sb = await req.one(
            f"create {kind}",
            AsyncSandbox.create(
                image="dsec/busybox" if vm else self.image,
                kind=kind,
                client=self.client,
                labels=LABELS,
                timeout=600,
                memory="192Mi" if vm else None,
            ),
        )
        if sb is None:
            return
        req.created.append(sb.id)
        self.created += 1
        self.started.set()
        async with self._progress:
            self._progress.notify_all()
        if vm:
            await self.vm_up.put(sb.id)
            await self.hold.wait()
        res = await req.one(f"exec on {kind}", sb.exec(self.command, timeout=60))
        if res is not None and (res.exit_code != 0 or "ok" not in res.stdout):
            req.failed_commands += 1
            req.examples.setdefault("failed_command", f"exit {res.exit_code}: {res.stderr[-200:]!r}")
        if i % 8 == 7 and not vm:
            name = f"chaos/snapshot:{sb.id}"
            if await req.one("snapshot", sb.snapshot(name)) is not None:
                await req.one("image removal", self.client.remove_image(name))
        await req.one(f"kill {kind}", sb.kill())

    async def at_least(self, created: int, timeout: float = 120.0) -> None:
        """Until ``created`` sandboxes of the burst exist (or ``timeout``: the fault acts then anyway)."""
        async with self._progress:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait_for(lambda: self.created >= created), timeout)


# ---- what is done to the node ----------------------------------------------------------------------


@dataclass
class Target:
    """The node under chaos, as a fault sees it."""

    state_dir: Path
    daemon_pid: int
    cache_dir: Path


Fault = Callable[[Target, Burst], Coroutine[Any, Any, str]]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def kill_fetcher(target: Target, burst: Burst) -> str:
    await burst.at_least(8)
    pid = int((target.state_dir / "images" / "fetcher" / "fetcher.pid").read_text().strip())
    _kill(pid)
    return f"SIGKILL to the layer fetcher (pid {pid}) after {burst.created} creations"


async def kill_daemon(target: Target, burst: Burst) -> str:
    await burst.at_least(16)
    _kill(target.daemon_pid)
    return f"SIGKILL to the daemon (pid {target.daemon_pid}) after {burst.created} creations"


async def kill_qemu(target: Target, burst: Burst) -> str:
    try:
        sandbox_id = await asyncio.wait_for(burst.vm_up.get(), 300)
        pid = _process_with(f"dsec-{sandbox_id}", comm="qemu-system-x86")
        if pid is None:
            return f"no QEMU found for {sandbox_id}"
        _kill(pid)
        return f"SIGKILL to the QEMU (pid {pid}) of microVM {sandbox_id}, before its exec"
    except TimeoutError:
        return "no microVM of the burst came up"
    finally:
        burst.hold.set()


async def kill_crun(target: Target, burst: Burst) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pid = _process_with(str(target.state_dir), comm="crun", also=("run", "create"))
        if pid is not None:
            _kill(pid)
            return f"SIGKILL to crun (pid {pid}) while it created a container, after {burst.created} creations"
        await asyncio.sleep(POLL)
    return "no crun caught creating a container"


def fill(directory: Path, name: str = "chaos-filler", leave: int = 0) -> int:
    """Take the free space of ``directory``'s file system but ``leave`` bytes; returns the bytes taken
    (in all, by this file). In steps: a tmpfs undoes a whole fallocate that fails, so one call for all
    the free space may take nothing."""
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if leave and free > leave:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, os.fstat(fd).st_size, free - leave)
        step = 64 << 20
        while not leave and step >= 4096:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, step)
            except OSError:
                step //= 16
        taken = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return taken


async def fill_state(target: Target, burst: Burst) -> str:
    # most of it before the burst, so the last bytes go at once when the burst is under way
    await asyncio.to_thread(fill, target.state_dir, leave=32 << 20)
    await burst.at_least(8)
    taken = await asyncio.to_thread(fill, target.state_dir)
    return f"filled the state directory's file system ({taken >> 20} MiB) after {burst.created} creations"


async def fill_cache(target: Target, burst: Burst) -> str:
    taken = await asyncio.to_thread(fill, target.cache_dir)
    return f"filled the layer cache's file system ({taken >> 20} MiB) before the burst's first fetches"


async def fill_sandbox(target: Target, burst: Burst) -> str:
    """One sandbox of the burst's image fills its own writable layer while the burst runs: its writes
    must stop at its disk limit with ENOSPC, and it must still answer."""
    sb = await AsyncSandbox.create(image="dsec/busybox", client=burst.client, labels=LABELS, disk="32Mi", timeout=600)
    try:
        # files of 8 MiB: one file alone would meet the file-size limit (EFBIG) before the disk's
        script = 'i=0; while out=$(dd if=/dev/zero of=/fill$i bs=1M count=8 2>&1); do i=$((i+1)); done; echo "$out" >&2'
        res = await sb.exec(script, timeout=120)
        answers = (await sb.exec("echo alive", timeout=30)).stdout == "alive\n"
    finally:
        await sb.kill()
    if "No space left" not in res.stderr:
        burst.problems.append(f"the sandbox's writes did not end with ENOSPC: {res.stderr[-200:]!r}")
    if not answers:
        burst.problems.append("the sandbox no longer answered once its writable layer was full")
    writes = "ended with ENOSPC" if "No space left" in res.stderr else "did not end with ENOSPC"
    after = "still answers" if answers else "no longer answers"
    return f"a sandbox filled its 32 MiB writable layer: its writes {writes}, it {after}"


def _process_with(needle: str, *, comm: str, also: tuple[str, ...] = ()) -> int | None:
    """A process whose name is ``comm`` and whose command line holds ``needle`` (and one of ``also``)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if Path(entry.path, "comm").read_text().strip() != comm:
                continue
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and (not also or any(f" {a} " in f" {cmdline} " for a in also)):
            return int(entry.name)
    return None


FAULTS: dict[str, tuple[str, Fault]] = {
    "fetcher": ("SIGKILL the layer fetcher", kill_fetcher),
    "daemon": ("SIGKILL the daemon, then restart it", kill_daemon),
    "qemu": ("SIGKILL a microVM's QEMU", kill_qemu),
    "crun": ("SIGKILL crun mid-create", kill_crun),
    "state-disk-full": ("fill the state directory's file system", fill_state),
    "layer-cache-full": ("fill the layer cache's file system", fill_cache),
    "sandbox-disk-full": ("fill a sandbox's writable layer", fill_sandbox),
}
