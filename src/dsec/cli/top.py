"""``dsec top``: a live view of a node (or a cluster gateway): capacity, admission, queue, use."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..errors import DsecError
from ..protocol.node import NodeStatus
from .common import TokenOpt, UrlOpt, console
from .common import client as _client
from .common import fail as _fail


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f}Mi"


def _bar(part: float, whole: float, width: int = 24) -> str:
    share = 0.0 if whole <= 0 else min(1.0, max(0.0, part / whole))
    filled = round(share * width)
    return "█" * filled + "·" * (width - filled) + f" {share:4.0%}"


def render(s: NodeStatus) -> Group:
    head = Text.assemble(
        (f"node {s.node}", "bold"),
        f"  dsec {s.version}  kinds {', '.join(s.kinds)}  ",
        (f"memory pressure {s.memory_pressure:.0%}", "red" if s.memory_pressure >= 0.9 else ""),
        f"  evictions {s.evictions}",
    )
    res = Table(box=None, pad_edge=False)
    for col in ("", "capacity", "ratio", "allocatable", "requested", "admitted", "used"):
        res.add_column(col, justify="right" if col else "left")
    res.add_row(
        "cpu",
        f"{s.capacity.cpu:g}",
        f"{s.ratios.cpu:g}x",
        f"{s.allocatable.cpu:g}",
        f"{s.requested.cpu:g}",
        _bar(s.requested.cpu, s.allocatable.cpu),
        f"{s.used.cpu:.2f} ({_bar(s.used.cpu, s.capacity.cpu, 10)})",
    )
    res.add_row(
        "memory",
        _mib(s.capacity.memory),
        f"{s.ratios.memory:g}x",
        _mib(s.allocatable.memory),
        _mib(s.requested.memory),
        _bar(s.requested.memory, s.allocatable.memory),
        f"{_mib(s.used.memory)} ({_bar(s.used.memory, s.capacity.memory, 10)})",
    )
    counts = "  ".join(
        f"{kind}: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        for kind, states in sorted(s.sandboxes.items())
    )
    starting = ", ".join(f"{k} {n}/{s.start_slots.get(k, '?')}" for k, n in sorted(s.starting.items())) or "none"
    queue = ", ".join(f"{q.tenant} {q.waiting} (oldest {q.oldest_s:.1f}s)" for q in s.queues) or "empty"
    idle = "not measured yet" if s.cpu_use_le_5pct is None else f"{s.cpu_use_le_5pct:.0%} of sandboxes"
    summary = Text(
        f"sandboxes  {counts or 'none'}\nstarting   {starting}\nqueue      {s.queued}: {queue}\n"
        f"cpu <= 5% of request: {idle}"
    )
    top = Table(title="busiest sandboxes (yours)", title_justify="left")
    top.add_column("id", no_wrap=True)  # ids are never cut (dsec top redraws to the terminal's width)
    top.add_column("kind")
    top.add_column("owner", no_wrap=True)
    for col in ("state", "cpu used/req", "memory used/req/limit", "age"):
        top.add_column(col)
    for u in s.top:
        ratio = u.cpu_used / u.cpu_request if u.cpu_request else 0.0
        top.add_row(
            u.id,
            u.kind,
            u.owner or "",
            u.state,
            f"{u.cpu_used:.3f}/{u.cpu_request:g} ({ratio:.0%})",
            f"{_mib(u.memory_used)}/{_mib(u.memory_request)}/{_mib(u.memory_limit)}",
            f"{u.age_s:.0f}s",
        )
    if not s.warm_pools:
        return Group(head, res, summary, top)
    pools = Table(title="warm pools", title_justify="left")
    pools.add_column("pool", no_wrap=True)
    for col in ("image", "kind", "idle/size", "filling", "claims", "misses", "refills", "drained", "waiting"):
        pools.add_column(col)
    for p in s.warm_pools:
        pools.add_row(
            p.name,
            p.spec.image,
            p.spec.kind,
            f"{p.idle}/{p.spec.size}",
            str(p.filling),
            str(p.claims),
            str(p.misses),
            str(p.refills),
            str(p.drained),
            p.waiting or "",
        )
    return Group(head, res, summary, pools, top)


def top(
    url: UrlOpt = None,
    token: TokenOpt = None,
    n: Annotated[int, typer.Option("--n", min=0, max=1000, help="Sandboxes to list, busiest first.")] = 15,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one view and exit (no live refresh).")] = False,
) -> None:
    """A live view of the node: capacity and oversubscription, admitted requests, queue, measured use, and
    your busiest sandboxes. Ctrl-C to leave."""
    try:
        client = _client(url, token)
        status = client.node(top=n)
        if once:
            console.print(render(status))
            return
        with Live(render(status), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(client.node(top=n)))
    except DsecError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass
