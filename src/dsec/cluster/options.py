"""What ``dsec cluster up`` is asked for: read by the runner and by the Ray side that starts the nodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RayOptions:
    """What ``dsec cluster up`` was asked for (see cli/cluster.py for each option's meaning)."""

    listen: str
    state_root: Path
    token: str
    repository: str | None = None
    address: str | None = None
    local_nodes: int = 0
    node_args: tuple[str, ...] = ()
    trajectory_db: str | None = None
    label: str | None = None  # KEY=VALUE: only Ray nodes with this label get a daemon
    interval: float = 1.0
    misses: int = 3
    keep_sandboxes: bool = False
    ready: Callable[[str], None] | None = None  # called with the gateway's URL once it serves
    e2b_listen: str | None = None  # the cluster's E2B API; every node then serves one on its own address
    e2b_domain: str | None = None  # E2B's sandbox domain at the gateway (get_host); None: localhost:PORT
