"""The demo job: N sandboxes at once, each grading one candidate patch; a live bar and a summary table."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import DaemonUnreachable, DsecError
from ..sdk.aio import AsyncClient, AsyncSandbox
from ..stats import percentile
from .project import FILES, GRADE, candidate_for

IMAGE = "dsec/debian:12"
SERVE = (sys.executable, "-m", "dsec", "serve")
CONSOLE_PORT = 8470  # the console of a daemon the demo starts: http://127.0.0.1:8470/ui/
console = Console()


@dataclass
class Outcome:
    index: int
    candidate: str
    reward: int = 0
    create_s: float = 0.0
    exec_s: float = 0.0
    error: str | None = None
    detail: str = ""


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    console: str | None = None  # the console's URL, when the demo started the daemon
    notes: list[str] = field(default_factory=list)


def _project_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _console_listen() -> str:
    """Where a daemon the demo starts listens: loopback, on CONSOLE_PORT if it is free."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no owner
        try:
            probe.bind(("127.0.0.1", CONSOLE_PORT))
        except OSError:
            probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _spawn_daemon(state_dir: Path, log: Path, listen: str) -> subprocess.Popen[bytes]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        return subprocess.Popen(
            [*SERVE, "--state-dir", str(state_dir), "--log-level", "warning", "--listen", listen],
            stdout=logf,
            stderr=logf,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


async def _ensure_daemon(url: str | None, token: str | None, state_dir: Path) -> tuple[AsyncClient, Daemon]:
    client = AsyncClient(url=url or f"unix://{state_dir / 'dsec.sock'}", token=token)
    daemon = Daemon()
    try:
        await client.health()
        if url is not None and url.startswith(("http://", "https://")):
            console.print(f"console: [bold]{url.rstrip('/')}/ui/[/bold] (log in with the daemon's token)")
        else:
            console.print(
                "[dim]console: this daemon listens on a unix socket; one started with --listen "
                "http://HOST:PORT serves the console at /ui/[/dim]"
            )
        return client, daemon
    except DaemonUnreachable:
        if url is not None:
            raise
    await client.aclose()
    daemon.log = state_dir / "demo-daemon.log"
    listen = _console_listen()
    console.print(
        f"[dim]no daemon running: starting `dsec serve --state-dir {state_dir} --listen {listen}` "
        f"(log: {daemon.log})[/dim]"
    )
    daemon.proc = await asyncio.to_thread(_spawn_daemon, state_dir, daemon.log, listen)
    deadline = time.monotonic() + 30
    while True:
        if daemon.proc.poll() is not None:
            raise DaemonUnreachable(f"the daemon exited at start; see {daemon.log}")
        with contextlib.suppress(DaemonUnreachable, FileNotFoundError):
            token = token or (state_dir / "token").read_text().strip()
            client = AsyncClient(url=listen, token=token)
            await client.health()
            daemon.console = f"{listen}/ui/"
            console.print(f"console: [bold]{daemon.console}[/bold]  token: [bold]{token}[/bold]")
            return client, daemon
        if time.monotonic() > deadline:
            raise DaemonUnreachable(f"the daemon did not answer within 30 s; see {daemon.log}")
        await asyncio.sleep(0.2)


async def _rollout(client: AsyncClient, index: int, run_id: str, project: bytes) -> Outcome:
    name, diff = candidate_for(index)
    out = Outcome(index, name)
    t0 = time.perf_counter()
    try:
        sb = await AsyncSandbox.create(
            image=IMAGE,
            client=client,
            memory="256Mi",
            timeout=300,
            labels={"demo": run_id, "rollout": str(index)},
        )
    except DsecError as e:
        out.error = e.code
        out.detail = e.message
        return out
    out.create_s = time.perf_counter() - t0
    try:
        await sb.files.upload_tar("/work", project)
        await sb.files.write("/tmp/candidate.diff", diff)
        t1 = time.perf_counter()
        res = await sb.exec(GRADE, timeout=120)
        out.exec_s = time.perf_counter() - t1
        out.reward = 1 if res.exit_code == 0 else 0
        out.detail = (
            "tests pass" if out.reward else ("patch did not apply" if "PATCH_FAILED" in res.stdout else "tests fail")
        )
    except DsecError as e:
        out.error = e.code
        out.detail = e.message
    except Exception as e:  # one broken rollout must not take the others down
        out.error = type(e).__name__
        out.detail = str(e)
    finally:
        with contextlib.suppress(DsecError):
            await sb.kill()
    return out


async def run_demo(n: int, concurrency: int, state_dir: Path, url: str | None, token: str | None) -> int:
    client, daemon = await _ensure_daemon(url, token, state_dir)
    run_id = uuid.uuid4().hex[:8]
    try:
        images = {i.name: i for i in await client.images()}
        if not images.get(IMAGE) or not images[IMAGE].ready:
            with console.status(f"building {IMAGE} from Debian packages (first run only, about a minute)…"):
                t = time.perf_counter()
                await client.build_image(IMAGE)
            console.print(f"built {IMAGE} in {time.perf_counter() - t:.0f} s")
        project = _project_tar()
        if daemon.console is not None and sys.stdin.isatty():
            # the burst takes seconds: a person who wants to watch it opens the console first
            console.print("log in to the console, then press Enter to start the rollouts")
            await asyncio.to_thread(sys.stdin.readline)
        gate = asyncio.Semaphore(concurrency)
        outcomes: list[Outcome] = []
        columns = (
            TextColumn("rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        started = time.perf_counter()
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("", total=n)

            async def one(i: int) -> None:
                async with gate:
                    o = await _rollout(client, i, run_id, project)
                outcomes.append(o)
                rewarded = sum(x.reward for x in outcomes)
                progress.update(
                    task,
                    advance=1,
                    description=f"reward 1: {rewarded}  errors: {sum(1 for x in outcomes if x.error)}",
                )

            await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - started
        leftovers = await client.list({"demo": run_id})
        for info in leftovers:
            with contextlib.suppress(DsecError):
                await (await AsyncSandbox.connect(info.id, client=client)).kill()
        _summary(outcomes, wall, n, len(leftovers))
        if daemon.console is not None and sys.stdin.isatty():
            console.print(f"the console stays at {daemon.console}: press Enter to stop the daemon")
            await asyncio.to_thread(sys.stdin.readline)
        return 0 if all(o.error is None for o in outcomes) and _expected(outcomes) else 1
    finally:
        await client.aclose()
        if daemon.proc is not None:
            daemon.proc.send_signal(signal.SIGTERM)
            try:
                daemon.proc.wait(15)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()


def _expected(outcomes: list[Outcome]) -> bool:
    """Each candidate kind must earn the reward it deserves: the demo checks its own grading."""
    return all((o.reward == 1) == (o.candidate == "correct") for o in outcomes if o.error is None)


def _summary(outcomes: list[Outcome], wall: float, n: int, leftovers: int) -> None:
    ok = [o for o in outcomes if o.error is None]
    create = [o.create_s * 1000 for o in ok]
    execs = [o.exec_s * 1000 for o in ok]
    table = Table(title=f"dsec demo: {n} rollouts on {IMAGE}", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("wall time", f"{wall:.2f} s")
    table.add_row("sandboxes / s", f"{n / wall:.1f}")
    for label, values in (("create", create), ("grading exec", execs)):
        spread = f"{percentile(values, 50):.0f} / {percentile(values, 99):.0f} ms" if values else "n/a"
        table.add_row(f"{label} p50 / p99", spread)
    for cand in ("correct", "wrong", "stale"):
        group = [o for o in ok if o.candidate == cand]
        table.add_row(f"reward 1 · {cand} patches", f"{sum(o.reward for o in group)} / {len(group)}")
    table.add_row("errors", str(sum(1 for o in outcomes if o.error)))
    table.add_row("sandboxes left behind", str(leftovers))
    console.print(table)
    for o in outcomes:
        if o.error:
            console.print(f"[red]rollout {o.index}[/red] {o.error}: {o.detail}")
    if not _expected(outcomes):
        console.print("[red]some rollouts got a reward their candidate does not deserve[/red]")


def main(n: int, concurrency: int, state_dir: Path, url: str | None, token: str | None) -> int:
    if os.geteuid() != 0 and url is None:
        console.print("[red]the demo starts a local daemon, which needs root[/red]")
        return 2
    try:
        return asyncio.run(run_demo(n, concurrency, state_dir, url, token))
    except DsecError as e:
        console.print(f"[red]error[/red] ({e.code}): {e.message}")
        return 2
