"""The wire models of E2B's control API (sandbox lifecycle), with E2B's own JSON names.

Requests ignore fields this layer does not know (newer SDKs add some); fields it knows but cannot honour
are refused by the routes with a clear error rather than silently dropped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from ..protocol.names import MAX_REFERENCE, NAME_BODY, ImageName
from ..protocol.network import ALLOW_DESTINATION
from ..protocol.sandbox import KINDS, MAX_TTL_S, TRAJECTORY_ID
from ..protocol.types import MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, PATH_MAX, Env
from ..protocol.volumes import MAX_VOLUMES, MOUNT_PATH, RESERVED_PATTERN, VOLUME_NAME, VolumeName
from .hosts import MASK_HOST, MAX_MASK_HOST

# the envd version this layer speaks: the SDK turns features on by it (octet-stream uploads from 0.5.7,
# file metadata from 0.6.2, watch entries from 0.6.3, network-mount watches from 0.6.4)
ENVD_VERSION = "0.6.4"
CLIENT_ID = "dsec"
DEFAULT_TIMEOUT = 300  # seconds, E2B's default time to live
MAX_TIMEOUT = int(MAX_TTL_S)
# a template id: an alias (--e2b-template, named by the same rule), 'base', or an image with an optional
# '@KIND' (e.g. dsec/debian:12@microvm)
TEMPLATE_ID = rf"^{NAME_BODY}(@(?:{'|'.join(KINDS)}))?$"
MAX_TEMPLATE_ID = MAX_REFERENCE  # an image name's bound: with '@KIND' the name is shorter, without it as long
# What the schema states of what dsec cannot honour: absent, null or empty (the routes refuse the rest
# with a 400 that says so); of network egress: allowOut entries are destinations, denyOut entries
# networks or addresses.
UNSUPPORTED = WithJsonSchema({"type": "null", "description": "Not supported by dsec (docs/e2b.md)."})
Destinations = Annotated[
    list[str] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "array",
                    "maxItems": 256,
                    "items": {"type": "string", "maxLength": 253, "pattern": ALLOW_DESTINATION},
                },
                {"type": "null"},
            ]
        }
    ),
]
# denyOut: networks and addresses (0.0.0.0/0: everything, allowOut then an allowlist)
DenyAll = Annotated[
    list[str] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "maxItems": 256, "items": {"type": "string", "maxLength": 43}},
                {"type": "null"},
            ]
        }
    ),
]
# metadata: the sandbox's labels (one is taken by the template id); dsec.* keys choose what E2B has no
# word for (their values checked as a sandbox's limits are)
METADATA_SCHEMA = {
    "type": "object",
    "maxProperties": MAX_LABELS - 3,  # this layer's own labels: the template, auto-resume, the masked host
    "propertyNames": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_LABEL_KEY,
        "not": {"pattern": "^dsec\\.e2b\\."},
    },
    "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE},
    "properties": {
        "dsec.kind": {"enum": list(KINDS)},
        "dsec.trajectory": {"type": "string", "pattern": TRAJECTORY_ID},
    },
}
Metadata = Annotated[dict[str, str], WithJsonSchema(METADATA_SCHEMA)]


# a mount's volume: its name, read-write, or with ':ro' (E2B's mounts have no flag for it)
MOUNT_REF = VOLUME_NAME.removesuffix("$") + "(:(ro|rw))?$"


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    def wire(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


class NetworkConfig(_In):
    allow_out: Destinations = Field(None, alias="allowOut")
    deny_out: DenyAll = Field(None, alias="denyOut")
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    mask_request_host: Annotated[
        str | None,
        WithJsonSchema({"type": "string", "maxLength": MAX_MASK_HOST, "pattern": MASK_HOST}),
    ] = Field(None, alias="maskRequestHost", description="The Host header the sandbox's servers are told.")
    rules: Annotated[Any, UNSUPPORTED] = None
    egress_proxy: Annotated[Any, UNSUPPORTED] = Field(None, alias="egressProxy")
    dns_servers: Annotated[Any, UNSUPPORTED] = Field(None, alias="dnsServers")
    https_ports: Annotated[Any, UNSUPPORTED] = Field(None, alias="httpsPorts")


# what a timeout does: kill, or pause (keeping memory: dsec has no filesystem-only pause)
ON_TIMEOUT_SCHEMA = {
    "anyOf": [
        {"enum": [None, "kill", "pause"]},
        {
            "type": "object",
            "properties": {"action": {"enum": ["kill", "pause"]}, "keep_memory": {"enum": [None, True]}},
            "required": ["action"],
        },
    ]
}
AutoResume = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "object", "properties": {"enabled": {"type": "boolean"}}},
                {"type": "boolean"},
                {"type": "null"},
            ]
        }
    ),
]


class Lifecycle(_In):
    on_timeout: Annotated[Any, WithJsonSchema(ON_TIMEOUT_SCHEMA)] = Field(None, alias="onTimeout")
    auto_resume: AutoResume = Field(None, alias="autoResume")


class VolumeMount(_In):
    """One of a creation's ``volumeMounts`` (E2B's SandboxVolumeMount)."""

    name: Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "maxLength": 66,
                "pattern": MOUNT_REF,
                "description": "A volume's name; 'NAME:ro' mounts it read-only (a dsec extension).",
            }
        ),
    ] = Field(..., min_length=1, max_length=66)
    # the creation checks the path as it checks dsec's own mounts, saying what is wrong with it
    path: Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "minLength": 2,
                "maxLength": PATH_MAX,
                "allOf": [{"pattern": MOUNT_PATH}, {"not": {"pattern": RESERVED_PATTERN}}],
            }
        ),
    ] = Field(..., min_length=1, max_length=PATH_MAX)


class NewSandbox(_In):
    """POST /v2/sandboxes (and the older POST /sandboxes)."""

    # the schema states the rule; the route checks it (saying which part is wrong: the kind, the image)
    template_id: Annotated[
        str, WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_TEMPLATE_ID, "pattern": TEMPLATE_ID})
    ] = Field(..., alias="templateID", min_length=1, max_length=MAX_TEMPLATE_ID)
    timeout: int = Field(DEFAULT_TIMEOUT, ge=1, le=MAX_TIMEOUT)
    auto_pause: bool = Field(False, alias="autoPause", description="Pause (not kill) at the timeout.")
    auto_pause_memory: Annotated[bool | None, WithJsonSchema({"enum": [None, True]})] = Field(
        None, alias="autoPauseMemory", description="dsec's pause keeps memory: false is refused."
    )
    auto_resume: AutoResume = Field(None, alias="autoResume")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    network: NetworkConfig | None = None
    metadata: Metadata = Field(default_factory=dict)
    env_vars: Env = Field(default_factory=dict, alias="envVars")
    # the SDK itself starts E2B's mcp-gateway in the sandbox with this configuration after the creation;
    # the server has nothing to do with it (the image must hold the gateway, as E2B's mcp template does)
    mcp: dict[str, Any] | None = Field(None, description="MCP servers for the SDK's mcp-gateway in the sandbox.")
    iam: Annotated[Any, UNSUPPORTED] = None
    volume_mounts: list[VolumeMount] | None = Field(None, alias="volumeMounts", max_length=MAX_VOLUMES)
    lifecycle: Lifecycle | None = None
    secure: bool | None = None


class TimeoutRequest(_In):
    timeout: int = Field(..., ge=0, le=MAX_TIMEOUT, description="Seconds from now; 0: the timeout is reached now.")


class RefreshRequest(_In):
    duration: int = Field(60, ge=1, le=3600, description="Seconds the sandbox lives at least from now.")


class PauseRequest(_In):
    memory: Annotated[bool | None, WithJsonSchema({"enum": [None, True]})] = None
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class ConnectRequest(_In):
    """POST /v2/sandboxes/{id}/connect, and the older /sandboxes/{id}/connect and /resume."""

    timeout: int = Field(DEFAULT_TIMEOUT, ge=1, le=MAX_TIMEOUT)
    memory: Annotated[bool | None, WithJsonSchema({"enum": [None, True]})] = None
    auto_pause: bool | None = Field(None, alias="autoPause")


class SnapshotRequest(_In):
    name: ImageName | None = None
    memory: bool | None = None


class ForkRequest(_In):
    timeout: int | None = Field(None, ge=1, le=MAX_TIMEOUT)
    count: int = Field(1, ge=1, le=20)


class NetworkUpdate(_In):
    allow_out: Destinations = Field(None, alias="allowOut")
    deny_out: DenyAll = Field(None, alias="denyOut")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    rules: Annotated[Any, UNSUPPORTED] = None


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


class MountedVolume(_Out):
    name: str
    path: str


class LifecycleInfo(_Out):
    auto_resume: bool = Field(..., alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(..., alias="onTimeout")


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(None, alias="envdAccessToken")
    allow_internet_access: bool | None = Field(None, alias="allowInternetAccess")
    domain: str | None = None
    volume_mounts: list[MountedVolume] = Field(default_factory=list, alias="volumeMounts")
    lifecycle: LifecycleInfo | None = None


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


class NewVolume(_In):
    """POST /volumes. A volume of dsec's default size (docs/e2b.md): E2B's API names none."""

    name: VolumeName


class Volume(_Out):
    volume_id: str = Field(..., alias="volumeID", description="Its name: dsec names volumes by name.")
    name: str


class VolumeAndToken(Volume):
    """A volume, with the token that opens its content API (``Authorization: Bearer``) to the caller."""

    token: str


class Error(_Out):
    code: int
    message: str
