"""The core's record of one sandbox."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from ..protocol import network as policy
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import Limits, OnTimeout, SandboxInfo, State
from ..protocol.volumes import MountedVolume

StartedFrom = Literal["boot", "snapshot", "fork"]

# The core's fields are persisted beside the kind's state, in the same JSON column, under these keys
# (the ones every record has had: a state database from an older daemon reads the same).
CORE_KEYS = (
    "node",
    "trajectory",
    "forked_from",
    "timings",
    "network",
    "accel",
    "waiting",
    "started_from",
    "volumes",
    "ports",
    "pool",
    "on_timeout",
    "checkpoints",
)


@dataclass(frozen=True)
class VolumeMount:
    """A named volume in a sandbox: where it sees it, how, and the volume's mount on the host that the
    kind binds from (the core's choice; a kind never names volumes' places itself)."""

    path: str
    name: str
    read_only: bool
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "read_only": self.read_only, "source": self.source}

    @staticmethod
    def from_json(value: object) -> VolumeMount | None:
        if not isinstance(value, dict):
            return None
        path, name, source = value.get("path"), value.get("name"), value.get("source")
        if not (isinstance(path, str) and isinstance(name, str) and isinstance(source, str)):
            return None
        return VolumeMount(path, name, value.get("read_only") is True, source)


@dataclass
class CheckpointRecord:
    """A checkpoint the sandbox took (core/checkpoints.py keeps its layers on the node's disk)."""

    id: str  # c1, c2, ... in the order the sandbox took them
    name: str | None
    created_at: float
    size: int  # bytes of the layer it added
    seconds: float  # how long taking it held the sandbox still

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "at": self.created_at, "size": self.size, "s": self.seconds}

    @staticmethod
    def from_json(value: object) -> CheckpointRecord | None:
        if not isinstance(value, dict) or not isinstance(value.get("id"), str):
            return None
        try:
            return CheckpointRecord(
                value["id"], _text(value.get("name")), float(value["at"]), int(value["size"]), float(value["s"])
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class SandboxRecord:
    id: str
    kind: str
    image: str
    state: State
    created_at: float
    expires_at: float
    limits: Limits
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    reason: str | None = None
    # the kind's own state (bundle, uid range, agent, ...): each kind reads and writes it through its
    # own typed view (kinds/*/state.py); nothing outside the kind looks inside
    runtime: dict[str, Any] = field(default_factory=dict)
    image_digest: str = ""  # the image version it runs on: a name can be freed and reused, a version cannot
    owner: str = "admin"  # the tenant it belongs to (records from before tenants: the operator's)
    network: NetworkSpec = None  # the network policy in force
    node: str | None = None  # the node it runs on
    trajectory: str | None = None  # the trajectory it is bound to
    forked_from: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase of its creation
    # reported by the kind, for its info
    accelerator: str | None = None  # VM kinds: kvm or tcg
    started_from: StartedFrom | None = None
    waiting: str | None = None  # what its creation waits for (a VM boot slot, ...)
    volumes: list[VolumeMount] = field(default_factory=list)  # named volumes it mounts, by the core's grant
    ports: dict[int, tuple[str, float]] = field(default_factory=dict)  # exposed port -> (secret, when)
    # the warm pool it idles in, until a creation claims it (core/warm.py): listed nowhere, no tenant's
    pool: str | None = None
    on_timeout: OnTimeout = "stop"  # what its time to live's end does: stop it, or pause it
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    checkpoints_taken: int = 0  # numbers the next one: ids are never reused within a sandbox

    def persisted(self) -> dict[str, Any]:
        """The kind's state and the core's fields, as stored."""
        core: dict[str, Any] = {
            "node": self.node,
            "trajectory": self.trajectory,
            "forked_from": self.forked_from,
            "timings": self.timings or None,
            "network": policy.to_json(self.network) if self.network is not None else None,
            "accel": self.accelerator,
            "waiting": self.waiting,
            "started_from": self.started_from,
            "volumes": [v.to_json() for v in self.volumes] or None,
            "ports": {str(p): [secret, at] for p, (secret, at) in self.ports.items()} or None,
            "pool": self.pool,
            "on_timeout": None if self.on_timeout == "stop" else self.on_timeout,
            "checkpoints": {"taken": self.checkpoints_taken, "list": [c.to_json() for c in self.checkpoints]}
            if self.checkpoints_taken
            else None,
        }
        return {**self.runtime, **{k: v for k, v in core.items() if v is not None}}

    def restore(self, stored: dict[str, Any]) -> None:
        """Split what ``persisted`` stored back into the kind's state and the core's fields."""
        runtime = dict(stored)
        core = {k: runtime.pop(k) for k in CORE_KEYS if k in runtime}
        self.runtime = runtime
        self.node = _text(core.get("node"))
        self.trajectory = _text(core.get("trajectory"))
        self.forked_from = _text(core.get("forked_from"))
        timings = core.get("timings")
        self.timings = {str(k): float(v) for k, v in timings.items()} if isinstance(timings, dict) else {}
        self.network = policy.from_json(core.get("network"))
        self.accelerator = _text(core.get("accel"))
        self.waiting = _text(core.get("waiting"))
        self.pool = _text(core.get("pool"))
        self.on_timeout = "pause" if core.get("on_timeout") == "pause" else "stop"
        started = core.get("started_from")
        if started is None and "restored" in runtime:  # written by a daemon from before this field
            started = "snapshot" if runtime.pop("restored") else "boot"
        self.started_from = started if started in ("boot", "snapshot", "fork") else None
        volumes = core.get("volumes")
        mounts = [VolumeMount.from_json(v) for v in volumes] if isinstance(volumes, list) else []
        self.volumes = [m for m in mounts if m is not None]
        taken = core.get("checkpoints")
        if isinstance(taken, dict):
            count = taken.get("taken")
            self.checkpoints_taken = count if isinstance(count, int) else 0
            listed = taken.get("list")
            found = [CheckpointRecord.from_json(c) for c in listed] if isinstance(listed, list) else []
            self.checkpoints = [c for c in found if c is not None]
        ports = core.get("ports")
        self.ports = {
            int(p): (str(g[0]), float(g[1]))
            for p, g in (ports.items() if isinstance(ports, dict) else ())
            if str(p).isdigit() and isinstance(g, list) and len(g) == 2
        }

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            kind=self.kind,
            image=self.image,
            state=self.state,
            reason=self.reason,
            created_at=datetime.fromtimestamp(self.created_at, UTC),
            expires_at=datetime.fromtimestamp(self.expires_at, UTC),
            limits=self.limits,
            labels=dict(self.labels),
            env=dict(self.env),
            accelerator=self.accelerator,
            started_from="fork" if self.forked_from else self.started_from,
            forked_from=self.forked_from,
            waiting=self.waiting,
            owner=self.owner,
            network=self.network,
            trajectory=self.trajectory,
            node=self.node,
            on_timeout=self.on_timeout,
            timings=dict(self.timings),
            volumes=[MountedVolume(path=v.path, name=v.name, mode="ro" if v.read_only else "rw") for v in self.volumes],
        )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def new_record(
    kind: str, image: str, digest: str, ttl: float, limits: Limits, env: dict[str, str], labels: dict[str, str]
) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id="sb-" + secrets.token_hex(6),
        kind=kind,
        image=image,
        image_digest=digest,
        state=State.creating,
        created_at=now,
        expires_at=now + ttl,
        limits=limits,
        env=dict(env),
        labels=dict(labels),
    )
