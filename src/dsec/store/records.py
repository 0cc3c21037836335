"""The core's record of one sandbox."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from ..protocol import network as policy
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import Limits, SandboxInfo, State


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
    runtime: dict[str, Any] = field(default_factory=dict)  # backend-owned (bundle path, cgroup path, ...)
    image_digest: str = ""  # the image version it runs on: a name can be freed and reused, a version cannot
    owner: str = "admin"  # the tenant it belongs to (records from before tenants: the operator's)

    @property
    def network(self) -> NetworkSpec:
        """The network policy in force; kept in ``runtime`` so that it is persisted with it."""
        return policy.from_json(self.runtime.get("network"))

    @network.setter
    def network(self, value: NetworkSpec) -> None:
        if value is None:
            self.runtime.pop("network", None)
        else:
            self.runtime["network"] = policy.to_json(value)

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
            accelerator=self.runtime.get("accel"),
            started_from=_started_from(self.runtime),
            forked_from=self.runtime.get("forked_from"),
            waiting=self.runtime.get("waiting"),
            owner=self.owner,
            network=self.network,
            trajectory=self.runtime.get("trajectory"),
            node=self.runtime.get("node"),
            timings=self.runtime.get("timings") or {},
        )


def _started_from(runtime: dict[str, Any]) -> Literal["boot", "snapshot", "fork"] | None:
    if runtime.get("forked_from"):
        return "fork"
    if "restored" in runtime:
        return "snapshot" if runtime["restored"] else "boot"
    return None


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
