"""The trajectory log on the wire: what a recorded call looks like, and the digest both sides compute.

A call's digest covers what it asks for (its op, its parameters in canonical JSON, the bytes it sends),
never when or how fast: a resumed trainer that issues the same call gets the same digest, in the SDK
(which fast-forwards locally) and in the daemon (which checks it and answers from the log).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, model_validator

SEQ_HEADER = "Dsec-Seq"  # a trajectory call's position; sent by the SDK on every call of a bound sandbox
REPLAYED_HEADER = "Dsec-Replayed"  # "1" on an answer taken from the log
# in an error's detail: the position the failed call holds in the log (it counts as a call). An error
# without it (a refused or diverging call, a lost connection) took no position.
RECORDED_AT = "recorded_at"

# Calls that change a sandbox: a rebuild re-applies them in order. The others are recorded for their
# results only (reads, grades, snapshots).
MUTATING_OPS = frozenset(
    {
        "exec",
        "write",
        "mkdir",
        "remove",
        "move",
        "upload",
        "set_metadata",
        "set_network",
        "kill",
        "checkpoint",
        "remove_checkpoint",
        "rollback",
    }
)
OPS = MUTATING_OPS | {"create", "read", "list", "stat", "download", "snapshot", "grade"}


def canonical(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def call_digest(op: str, params: dict[str, Any] | str, payload: bytes | None = None) -> str:
    """``params``: the parameters, or their canonical JSON already made."""
    h = blake3.blake3()
    h.update(op.encode())
    h.update(b"\0")
    h.update((params if isinstance(params, str) else canonical(params)).encode())
    h.update(b"\0")
    h.update(blake3.blake3(payload or b"").digest())
    return h.hexdigest()


class TrajectoryInfo(BaseModel):
    id: str
    sandbox_id: str = Field(description="The sandbox bound to it now (a rebuild binds a new one).")
    kind: str
    image: str
    created_at: datetime
    updated_at: datetime
    length: int = Field(description="Calls recorded, the create (position 0) included.")
    closed: bool = Field(description="A recorded kill ended its sandbox: it is not rebuilt.")
    rebuilds: int = Field(description="How many times a lost sandbox was rebuilt from the log.")


class TrajectoryList(BaseModel):
    trajectories: list[TrajectoryInfo]


class RecordedCall(BaseModel):
    seq: int
    op: str
    digest: str
    request: dict[str, Any] = Field(description="The call's parameters (canonical form).")
    status: Literal["running", "done", "error", "interrupted"]
    result: dict[str, Any] | None = Field(None, description="The result model, or {'error': {...}}.")
    result_bytes: str | None = Field(None, description="Bytes the call returned (reads, archives), base64.")
    payload_bytes: int = Field(0, description="Size of the bytes the call sent (file contents, archives).")
    started_at: datetime
    duration_ms: float | None = None
    note: str | None = Field(None, description="E.g. how a rebuild's re-run of this call differed.")
    replays: int = Field(
        0,
        ge=0,
        description="How often the daemon answered this position again from the log, not running it: a "
        "resumed client's call sent to the daemon (at 0: the create that resumed the trajectory). Calls the "
        "SDK fast-forwards locally from a fetched page never reach the daemon and are not counted.",
    )
    replayed_at: datetime | None = Field(None, description="When it was last answered from the log.")


class ReplayedCalls(BaseModel):
    """Calls a client answered itself from the recorded log (the SDK fast-forwarding a resumed
    trajectory), told to the daemon once the replay ends so each call's ``replays`` counts them."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=1, description="The first replayed position (0, the create, the daemon counts itself).")
    end: int = Field(ge=2, description="One past the last replayed position.")

    @model_validator(mode="after")
    def _ordered(self) -> ReplayedCalls:
        if self.end <= self.start:
            raise ValueError("end must be greater than start")
        return self


class RecordedCalls(BaseModel):
    calls: list[RecordedCall]
    next: int | None = Field(description="The position to ask for next, or None at the end of the log.")
