"""The core's record of one sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from ..models import Limits, SandboxInfo, State


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
    network: str = "none"  # "host" only for the daemon's own builder sandboxes; not persisted (used at create)

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
        )


def _started_from(runtime: dict[str, Any]) -> Literal["boot", "snapshot", "fork"] | None:
    if runtime.get("forked_from"):
        return "fork"
    if "restored" in runtime:
        return "snapshot" if runtime["restored"] else "boot"
    return None
