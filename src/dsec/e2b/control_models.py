"""The wire models of E2B's control API (sandbox lifecycle), with E2B's own JSON names.

Requests ignore fields this layer does not know (newer SDKs add some); fields it knows but cannot honour
are refused by the routes with a clear error rather than silently dropped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# the envd version this layer speaks: the SDK turns features on by it (octet-stream uploads from 0.5.7,
# file metadata from 0.6.2, watch entries from 0.6.3, network-mount watches from 0.6.4)
ENVD_VERSION = "0.6.4"
CLIENT_ID = "dsec"
DEFAULT_TIMEOUT = 300  # seconds, E2B's default time to live


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    def wire(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


class NetworkConfig(_In):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    mask_request_host: str | None = Field(None, alias="maskRequestHost")
    rules: Any = None
    egress_proxy: Any = Field(None, alias="egressProxy")
    dns_servers: Any = Field(None, alias="dnsServers")
    https_ports: Any = Field(None, alias="httpsPorts")


class Lifecycle(_In):
    on_timeout: Any = Field(None, alias="onTimeout")
    auto_resume: Any = Field(None, alias="autoResume")


class NewSandbox(_In):
    """POST /v2/sandboxes (and the older POST /sandboxes)."""

    template_id: str = Field(..., alias="templateID", min_length=1, max_length=300)
    timeout: int = Field(DEFAULT_TIMEOUT, ge=1)
    auto_pause: bool = Field(False, alias="autoPause")
    auto_pause_memory: Any = Field(None, alias="autoPauseMemory")
    auto_resume: Any = Field(None, alias="autoResume")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    network: NetworkConfig | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    mcp: Any = None
    iam: Any = None
    volume_mounts: list[Any] | None = Field(None, alias="volumeMounts")
    lifecycle: Lifecycle | None = None
    secure: bool | None = None


class TimeoutRequest(_In):
    timeout: int = Field(..., ge=0)


class PauseRequest(_In):
    memory: bool | None = None
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class ConnectRequest(_In):
    """POST /v2/sandboxes/{id}/connect, and the older /sandboxes/{id}/connect and /resume."""

    timeout: int = Field(DEFAULT_TIMEOUT, ge=1)
    memory: bool | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")


class SnapshotRequest(_In):
    name: str | None = Field(None, max_length=256)
    memory: bool | None = None


class ForkRequest(_In):
    timeout: int | None = Field(None, ge=1)
    count: int = Field(1, ge=1, le=20)


class NetworkUpdate(_In):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    rules: Any = None


class Sandbox(_Out):
    """A created, resumed or connected sandbox: what the SDK needs to reach it."""

    template_id: str = Field(..., alias="templateID")
    sandbox_id: str = Field(..., alias="sandboxID")
    client_id: str = Field(CLIENT_ID, alias="clientID")
    envd_version: str = Field(ENVD_VERSION, alias="envdVersion")
    envd_access_token: str | None = Field(None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(None, alias="trafficAccessToken")
    domain: str | None = None
    alias: str | None = None


class ListedSandbox(_Out):
    template_id: str = Field(..., alias="templateID")
    sandbox_id: str = Field(..., alias="sandboxID")
    client_id: str = Field(CLIENT_ID, alias="clientID")
    started_at: datetime = Field(..., alias="startedAt")
    end_at: datetime = Field(..., alias="endAt")
    cpu_count: int = Field(..., alias="cpuCount")
    memory_mb: int = Field(..., alias="memoryMB")
    disk_size_mb: int = Field(..., alias="diskSizeMB")
    state: Literal["running", "paused"]
    envd_version: str = Field(ENVD_VERSION, alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)
    alias: str | None = None


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(None, alias="envdAccessToken")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    domain: str | None = None


class SandboxMetric(_Out):
    timestamp: datetime
    timestamp_unix: int = Field(..., alias="timestampUnix")
    cpu_count: int = Field(..., alias="cpuCount")
    cpu_used_pct: float = Field(..., alias="cpuUsedPct")
    mem_used: int = Field(..., alias="memUsed")
    mem_total: int = Field(..., alias="memTotal")
    mem_cache: int = Field(0, alias="memCache")
    disk_used: int = Field(0, alias="diskUsed")
    disk_total: int = Field(..., alias="diskTotal")


class SnapshotInfo(_Out):
    snapshot_id: str = Field(..., alias="snapshotID")
    names: list[str] = Field(default_factory=list)


class ForkError(_Out):
    code: int
    message: str


class ForkResult(_Out):
    sandbox: Sandbox | None = None
    error: ForkError | None = None


class Error(_Out):
    code: int
    message: str
