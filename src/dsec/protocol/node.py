"""Wire models of a node's capacity and admission, batch creation and tenant quotas (issue 8).

A node admits a sandbox while the sum of the requests it has admitted stays within its capacity times
the oversubscription ratio, per resource; what does not fit waits in a fair per-tenant queue until its
deadline, then is answered 429 with Retry-After. The gateway of a cluster places creations from the
same figures (``GET /v1/node``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .checkpoints import CheckpointSupport
from .pools import WarmPoolInfo
from .sandbox import TRAJECTORY_ID, ErrorBody, SandboxInfo, SandboxSpec
from .types import Size, int_range, on_type

MAX_SANDBOXES = 10_000  # in one batch creation
MAX_TOP = 10_000  # GET /v1/node?top=N: at most this many of the caller's sandboxes
MAX_QUOTA_MEMORY = 1 << 50  # 1Pi: within 2**53, where a JSON number is still exact for every client


class Resources(BaseModel):
    cpu: float = Field(description="Cores.")
    memory: int = Field(description="Bytes.")


class Ratios(BaseModel):
    cpu: float = Field(description="Oversubscription of CPU: requests may add up to capacity x this.")
    memory: float = Field(description="Oversubscription of memory: requests may add up to capacity x this.")


class TenantQueue(BaseModel):
    tenant: str
    waiting: int = Field(description="Creations of this tenant waiting for capacity.")
    oldest_s: float = Field(description="Seconds the oldest of them has waited.")


class SandboxUsage(BaseModel):
    id: str
    kind: str
    owner: str | None
    state: str
    cpu_request: float = Field(description="Cores requested.")
    cpu_used: float = Field(description="Cores used on average over the last sampling interval.")
    memory_request: int
    memory_limit: int
    memory_used: int = Field(description="Bytes charged to the sandbox's memory cgroup (VMs: the VMM's).")
    age_s: float


class NodeStatus(BaseModel):
    """What a node holds and can still admit (GET /v1/node)."""

    node: str = Field(description="The node's name (--node-name, default the host name).")
    version: str
    kinds: list[str] = Field(description="The kinds this node runs.")
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="Kinds this node cannot run, each with the prerequisite its probe found missing "
        "(in a cluster: the kinds no node runs, with one node's reason).",
    )
    capacity: Resources = Field(description="What the node has for sandboxes (host figures minus the reserve).")
    ratios: Ratios
    allocatable: Resources = Field(description="capacity x ratios: the sum of requests the node admits.")
    requested: Resources = Field(description="Sum of the requests of the sandboxes admitted now.")
    free: Resources = Field(description="allocatable - requested.")
    used: Resources = Field(description="Measured use of the sandboxes (CPU: cores over the last interval).")
    sandboxes: dict[str, dict[str, int]] = Field(description="Live sandboxes: kind -> state -> count.")
    owners: dict[str, int] = Field(
        default_factory=dict,
        description="Live sandboxes per tenant (the operator's are admin's); a tenant sees its own count.",
    )
    queued: int = Field(description="Creations waiting for capacity.")
    queues: list[TenantQueue] = Field(default_factory=list)
    starting: dict[str, int] = Field(description="Creations in progress, per kind.")
    start_slots: dict[str, int] = Field(description="Creations a kind runs at once (VM boots are bounded).")
    memory_pressure: float = Field(description="Share of the host's memory in use (0-1).")
    evictions: int = Field(description="Sandboxes evicted under memory pressure since the daemon started.")
    cpu_use_le_5pct: float | None = Field(
        None,
        description="Share of the measured sandboxes that used at most 5% of their CPU request over the last "
        "sampling interval (none measured yet: null).",
    )
    top: list[SandboxUsage] = Field(
        default_factory=list, description="The caller's sandboxes using the most CPU (with ?top=N)."
    )
    e2b_url: str | None = Field(
        None, description="Where the node serves the E2B-compatible API (dsec serve --e2b-listen), if it does."
    )
    warm_pools: list[WarmPoolInfo] = Field(
        default_factory=list,
        description="The node's warm pools (a tenant: those serving it); their idle sandboxes are counted in "
        "sandboxes and requested, never listed.",
    )
    checkpoints: dict[str, CheckpointSupport] = Field(
        default_factory=dict,
        description="Per kind, what its checkpoints and forks capture on this node (in a cluster: one node's).",
    )


class BatchCreate(BaseModel):
    """Create ``count`` sandboxes alike (POST /v1/sandboxes/batch)."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=1, le=MAX_SANDBOXES, description="How many sandboxes.")
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec, description="What each one is.")
    trajectories: list[Annotated[str, Field(pattern=TRAJECTORY_ID)]] | None = Field(
        None,
        max_length=MAX_SANDBOXES,
        json_schema_extra=on_type("array", uniqueItems=True),
        description="One trajectory id per sandbox (exactly count of them, all different), to bind each to its own.",
    )


class BatchEvent(BaseModel):
    """One line of a batch's answer (NDJSON): a sandbox ready, a creation failed, or the summary at the end."""

    index: int | None = Field(None, description="Which of the batch (0-based); none on the summary line.")
    sandbox: SandboxInfo | None = None
    error: ErrorBody | None = None
    done: bool = Field(False, description="The summary line, last of the stream.")
    created: int = 0
    failed: int = 0


class TenantQuota(BaseModel):
    """What one tenant may hold on a node at once (none: no bound of its own, only the node's)."""

    model_config = ConfigDict(extra="forbid")

    sandboxes: int | None = Field(None, ge=0, le=1_000_000, description="Live sandboxes.")
    cpu: float | None = Field(None, ge=0, le=1_000_000, description="Sum of CPU requests, in cores.")
    memory: Size | None = Field(
        None,
        json_schema_extra=int_range(0, MAX_QUOTA_MEMORY),
        description="Sum of memory requests, in bytes (or '64Gi').",
    )

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_QUOTA_MEMORY:
            raise ValueError("memory must be at most 1Pi")
        return v


class HistoryBucket(BaseModel):
    at: int = Field(description="The minute's start, Unix seconds.")
    created: dict[str, int] = Field(default_factory=dict, description="Sandboxes created, per kind.")
    failed: dict[str, int] = Field(default_factory=dict, description="Creations that failed, per reason (error code).")


class NodeHistory(BaseModel):
    """The last hour of creations, one bucket per minute, oldest first (GET /v1/node/history); a tenant
    sees its own."""

    step_s: int = Field(description="Seconds per bucket.")
    buckets: list[HistoryBucket]


class UsageSample(BaseModel):
    at: float = Field(description="When it was sampled, Unix seconds.")
    cpu_used: float = Field(description="Cores used on average over the sampling interval.")
    memory: int = Field(description="Bytes charged to the sandbox's memory cgroup (VMs: the VMM's).")


class UsageSeries(BaseModel):
    """A sandbox's measured use over the last minutes, oldest first (GET /v1/sandboxes/{id}/usage)."""

    samples: list[UsageSample]
