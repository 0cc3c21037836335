"""Wire models: the JSON contract between the SDK and the daemon (the OpenAPI spec is generated from these)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .build import BuildSpec
from .checkpoints import CHECKPOINT_REF
from .names import PULL_POLICY_DOC, ImageName, PullPolicy, TenantName
from .network import NetworkSpec
from .residue import MAX_CANARIES, Canaries, ScrubRule
from .types import MAX_COMMAND, USER_SPEC, AbsPath, Command, Env, Labels, Size, int_range
from .volumes import VOLUMES_DOC, MountedVolume, Volumes

Kind = Literal["container", "function", "microvm", "vm"]
KINDS: tuple[str, ...] = ("container", "function", "microvm", "vm")

MAX_TTL_S = 7 * 24 * 3600.0
MAX_EXEC_TIMEOUT_S = 24 * 3600.0
DEFAULT_OUTPUT_CAP = 1 << 20
MAX_OUTPUT_CAP = 64 << 20
MAX_STDIN = 16 << 20
DEFAULT_CPU_REQUEST = 0.25  # cores; idle agent sandboxes average a few percent of what they request
MIN_MEMORY, MAX_MEMORY = 8 << 20, 1 << 40
MIN_DISK, MAX_DISK = 1 << 20, 16 << 40
# the runtime writes files of its own under the sandbox's RLIMIT_FSIZE before the sandbox starts (crun
# its seccomp filter, several KiB): below this a sandbox could not start
MIN_FILE_SIZE = 1 << 20


class State(StrEnum):
    creating = "creating"
    running = "running"
    paused = "paused"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"
    lost = "lost"


TERMINAL_STATES = frozenset({State.stopped, State.failed, State.lost})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    """Resources of one sandbox. ``cpu`` is the request (it sets the cpu weight); ``cpu_limit`` an optional ceiling."""

    cpu: float = Field(
        DEFAULT_CPU_REQUEST,
        gt=0,
        le=256,
        description="CPU request in cores: what admission counts against the node (oversubscribed, 8x by "
        "default) and what sets the cpu weight. Idle agent sandboxes use a few percent of it.",
    )
    cpu_limit: float | None = Field(None, gt=0, le=256, description="Hard CPU ceiling in cores (none: no ceiling).")
    memory: Size = Field(
        512 << 20,
        json_schema_extra=int_range(MIN_MEMORY, MAX_MEMORY),
        description="Hard memory limit in bytes (or '512Mi'; 8Mi to 1Ti): past it the OOM killer.",
    )
    memory_request: Size | None = Field(
        None,
        json_schema_extra=int_range(0, MAX_MEMORY),
        description="Memory request in bytes (or '128Mi'): what admission counts against the node, and what "
        "the sandbox is reclaimed down to first under host memory pressure. Default: a quarter of the limit.",
    )
    disk: Size = Field(
        1 << 30,
        json_schema_extra=int_range(MIN_DISK, MAX_DISK),
        description="Size limit of the writable layer in bytes (or '1Gi'; 1Mi to 16Ti).",
    )
    pids: int = Field(1024, ge=8, le=1 << 20, description="Maximum number of processes and threads.")
    nofile: int = Field(65536, ge=64, le=1 << 20, description="RLIMIT_NOFILE (soft and hard) of every process.")
    file_size: Size | None = Field(
        None,
        json_schema_extra=int_range(MIN_FILE_SIZE, MAX_DISK),
        description="RLIMIT_FSIZE of every process in bytes (or '100Mi'; 1Mi to 16Ti); default: the disk limit.",
    )

    @field_validator("memory")
    @classmethod
    def _memory_floor(cls, v: int) -> int:
        if v < MIN_MEMORY:
            raise ValueError("memory must be at least 8Mi")
        if v > MAX_MEMORY:
            raise ValueError("memory must be at most 1Ti")
        return v

    @model_validator(mode="after")
    def _request_within_limit(self) -> Limits:
        if self.memory_request is not None and self.memory_request > self.memory:
            raise ValueError(f"memory_request ({self.memory_request}) exceeds the memory limit ({self.memory})")
        return self

    def mem_request(self) -> int:
        """The memory admission counts: memory_request, or a quarter of the limit."""
        return self.memory_request if self.memory_request is not None else self.memory // 4

    @field_validator("disk")
    @classmethod
    def _disk_floor(cls, v: int) -> int:
        if v < MIN_DISK:
            raise ValueError("disk must be at least 1Mi")
        if v > MAX_DISK:
            raise ValueError("disk must be at most 16Ti")
        return v

    @field_validator("file_size")
    @classmethod
    def _file_size_floor(cls, v: int | None) -> int | None:
        if v is not None and v < MIN_FILE_SIZE:
            raise ValueError("file_size must be at least 1Mi (the runtime writes files of its own under it)")
        if v is not None and v > MAX_DISK:
            raise ValueError("file_size must be at most 16Ti")
        return v

    def fsize(self) -> int:
        """RLIMIT_FSIZE in bytes: file_size, or the disk limit (no single file can be larger anyway)."""
        return self.file_size if self.file_size is not None else self.disk


OnTimeout = Literal["stop", "pause"]
ON_TIMEOUT_DOC = (
    "What reaching the time to live does: 'stop' ends the sandbox; 'pause' pauses it (its processes and "
    "memory kept, resumed by a resume), and it is then kept paused for up to the longest time to live."
)
# letters, digits and . _ : / @ + -, starting with a letter or digit; at most 200
TRAJECTORY_ID = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"


class SandboxSpec(_Strict):
    """What a sandbox is: a single creation's body without its trajectory, and each one of a batch."""

    image: ImageName = Field("dsec/debian:12")
    kind: Kind = Field("container", description="Sandbox kind.")
    limits: Limits = Field(default_factory=lambda: Limits())
    timeout: float = Field(600.0, gt=0, le=MAX_TTL_S, description="Time to live in seconds; reaped after.")
    env: Env = Field(default_factory=dict, description="Environment of every exec.")
    labels: Labels = Field(default_factory=dict, description="Free-form labels to filter lists by.")
    network: NetworkSpec = Field(
        None,
        description="None: loopback only. 'full': anything but the host, the daemon, metadata and other sandboxes. "
        "{'allow': ['CIDR:PORT', 'IP:PORT', 'NAME:PORT', ...]} (PORT a number or '*'): only those, tcp and udp; "
        "names through the platform's resolver. Container kind only for now.",
    )
    queue_timeout: float | None = Field(
        None,
        ge=0,
        le=3600,
        description="Seconds the creation may wait in the node's queue for capacity before it is answered 429 "
        "with Retry-After (0: answer at once). Default: the node's --queue-timeout.",
    )
    volumes: Volumes = Field(default_factory=dict, description=VOLUMES_DOC)
    pull: PullPolicy = Field("if-not-present", description=PULL_POLICY_DOC)
    on_timeout: OnTimeout = Field("stop", description=ON_TIMEOUT_DOC)


class CreateSandbox(SandboxSpec):
    trajectory: str | None = Field(
        None,
        pattern=TRAJECTORY_ID,
        description="Bind the sandbox to this trajectory (e.g. 'job-17/rollout-3'): its calls are logged, and "
        "creating with the same id again returns the bound sandbox (rebuilt if it is gone) to fast-forward.",
    )


class SandboxInfo(BaseModel):
    id: str
    kind: Kind
    image: str
    state: State
    reason: str | None = None
    created_at: datetime
    expires_at: datetime
    limits: Limits
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    accelerator: Literal["kvm", "tcg"] | None = Field(
        default=None, description="For VM kinds: hardware virtualisation (kvm) or software emulation (tcg)."
    )
    started_from: Literal["boot", "snapshot", "fork"] | None = Field(
        default=None,
        description="For VM kinds: booted cold, restored from a template's memory snapshot, or forked from a VM.",
    )
    forked_from: str | None = Field(default=None, description="The sandbox this one was forked from, if any.")
    waiting: str | None = Field(
        default=None,
        description="While creating: what the sandbox waits for (its image's pull, a VM boot slot), if anything.",
    )
    owner: str | None = Field(default=None, description="The tenant the sandbox belongs to.")
    network: NetworkSpec = Field(default=None, description="The sandbox's network policy now.")
    trajectory: str | None = Field(default=None, description="The trajectory this sandbox is bound to, if any.")
    trajectory_length: int | None = Field(
        default=None,
        description="Calls the trajectory has recorded, its create included (in a create's answer): a client "
        "that resumes fast-forwards through them.",
    )
    node: str | None = Field(default=None, description="The node the sandbox runs on.")
    on_timeout: OnTimeout = Field(default="stop", description=ON_TIMEOUT_DOC)
    volumes: list[MountedVolume] = Field(default_factory=list, description="The named volumes it mounts.")
    timings: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds the creation spent in each phase: queue (waiting for capacity and a start slot), "
        "rootfs (layers and writable layer), runtime (runtime start until the agent answers), total.",
    )


class NetworkStatus(BaseModel):
    policy: NetworkSpec = Field(description="The policy in force.")
    address: str | None = Field(default=None, description="The sandbox's address (None: loopback only).")
    resolver: str | None = Field(default=None, description="The platform resolver the sandbox's resolv.conf names.")
    denied_packets: int = Field(0, description="Packets dropped by the policy (connection attempts and their retries).")
    denied_dns: int = Field(0, description="DNS queries refused (names not on the allowlist).")
    allowed: list[str] = Field(
        default_factory=list, description="Destinations open now: static entries and resolved names' addresses."
    )


class ForkRequest(_Strict):
    n: int = Field(1, ge=1, le=64, description="How many copies.")
    timeout: float | None = Field(
        None, gt=0, le=MAX_TTL_S, description="Time to live of each copy in seconds; default: the parent's."
    )
    labels: Labels | None = Field(None, description="Labels of the copies; default: the parent's.")
    checkpoint: str | None = Field(
        None,
        pattern=CHECKPOINT_REF,
        description="Copies of this checkpoint (id or name) rather than of the sandbox as it is now (container kind).",
    )
    processes: bool | None = Field(
        None,
        description="Carry processes and memory into the copies: true asks for it (VM kinds do it; an error "
        "elsewhere), false for files only; default: what the kind can.",
    )


class ForkFailure(BaseModel):
    index: int = Field(ge=0, description="Which copy (0 .. n-1).")
    error: ErrorBody


class ForkResult(BaseModel):
    sandboxes: list[SandboxInfo]
    seconds: float = Field(description="From the request to the last copy answering.")
    failed: list[ForkFailure] = Field(
        default_factory=list,
        description="Copies that failed, each with its error (container kind: each copy stands alone; VM kinds "
        "keep all or none).",
    )


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]
    total: int | None = Field(None, description="With ?limit: how many matched in all (the page is a part).")


class ExecRequest(_Strict):
    cmd: Command = Field(..., description="A string is run by /bin/sh -c; a list is the argv.")
    timeout: float = Field(60.0, gt=0, le=MAX_EXEC_TIMEOUT_S, description="Seconds before the whole tree is killed.")
    idle_timeout: float | None = Field(
        None,
        gt=0,
        le=MAX_EXEC_TIMEOUT_S,
        description="Seconds without a byte on stdout or stderr before the whole tree is killed (none: no limit).",
    )
    cwd: AbsPath | None = Field(None, description="Working directory (absolute).")
    env: Env = Field(default_factory=dict)
    stdin: str | None = Field(None, max_length=MAX_STDIN, description="Text fed to standard input.")
    user: str | None = Field(
        None,
        pattern=USER_SPEC,
        description="Run as this account of the image (NAME, UID, NAME:GROUP, UID:GID; 'root'); "
        "default: the image's runtime user.",
    )
    output_limit: int = Field(
        DEFAULT_OUTPUT_CAP, ge=1024, le=MAX_OUTPUT_CAP, description="Bytes kept per stream (head and tail)."
    )

    @model_validator(mode="after")
    def _size(self) -> ExecRequest:
        parts = [self.cmd] if isinstance(self.cmd, str) else self.cmd
        total = sum(len(p.encode()) + 1 for p in parts) + sum(len(k) + len(v) + 2 for k, v in self.env.items())
        if total > MAX_COMMAND:
            raise ValueError(f"command and environment take {total} bytes, over the {MAX_COMMAND}-byte limit")
        return self

    def argv(self) -> list[str]:
        return ["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else list(self.cmd)


class ExecResult(BaseModel):
    exit_code: int | None = Field(None, description="Exit status, or None when a signal ended the process.")
    signal: int | None = Field(None, description="Terminating signal number, if any.")
    stdout: str = ""
    stderr: str = ""
    truncated: bool = Field(False, description="True if either stream exceeded output_limit.")
    stdout_bytes: int = Field(0, description="Total bytes the process wrote to stdout.")
    stderr_bytes: int = Field(0, description="Total bytes the process wrote to stderr.")
    timed_out: bool = Field(False, description="Killed by a timeout: the wall clock's or the idle-output one.")
    idle_timed_out: bool = Field(False, description="Killed because it wrote no output for idle_timeout seconds.")
    oom_killed: bool = False
    duration: float = 0.0
    replayed: bool = Field(False, description="The recorded result of a trajectory's call, not a new run.")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecEvent(BaseModel):
    """One line of a streamed exec: output as it comes, then the result."""

    type: Literal["stdout", "stderr", "result", "error"]
    data: str | None = None
    result: ExecResult | None = None
    error: ErrorBody | None = None


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int | None = Field(None, description="owner, as the sandbox numbers it (None: not known)")
    gid: int | None = Field(None, description="group, as the sandbox numbers it (None: not known)")
    link_target: str | None = Field(
        None, description="a symlink's target as the link says it, made absolute against the link's directory"
    )
    link_type: Literal["file", "dir", "other"] | None = Field(
        None, description="what a symlink resolves to inside the sandbox (None: nothing, a dangling link)"
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        description="the file's user-defined metadata: its `user.e2b.*` extended attributes, without the prefix "
        "(a write replaces the file, and drops them)",
    )


class FileList(BaseModel):
    entries: list[FileEntry]


class LayerInfo(BaseModel):
    digest: str = Field(description="blake3 of the layer's EROFS image")
    role: Literal["base", "toolkit", "workspace", "diff"]
    size: int
    created_by: str = ""


class ImageInfo(BaseModel):
    name: str
    size: int
    created_at: datetime | None = None
    ready: bool = Field(description="Published in the repository (a built-in image not built yet is not ready).")
    description: str = ""
    digest: str | None = Field(default=None, description="The immutable version this name points at.")
    layers: list[LayerInfo] = Field(default_factory=list, description="Lowest first.")
    parent: str | None = Field(default=None, description="The version this one was built on or snapshotted from.")
    source_sandbox: str | None = Field(default=None, description="The sandbox a snapshot was taken of.")
    scrubbed: list[str] = Field(default_factory=list, description="Residue left out when the layers were packed.")
    owner: str | None = Field(
        default=None, description="The tenant that made it; none for built-in and operator images (public)."
    )


CANARIES_DOC = "Canary strings (8-4096 characters): the publish is refused if any layer of the image holds one."


class SnapshotRequest(BaseModel):
    """pack_diff: the sandbox's changes become a new image version on top of its image."""

    model_config = ConfigDict(extra="forbid")

    name: ImageName = Field(description="repo:tag of the new image; must not exist yet.")
    scrub: list[ScrubRule] = Field(
        default_factory=list, max_length=1024, description="Extra residue rules (globs relative to /)."
    )
    scrub_defaults: bool = Field(default=True, description="Apply the node's default residue rules too.")
    description: str = Field(default="", max_length=4096)
    canaries: Canaries = Field(default_factory=list, max_length=MAX_CANARIES, description=CANARIES_DOC)


class ImportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ImageName
    path: AbsPath = Field(description="OCI layout directory or docker-save tarball on the node (absolute).")
    reference: str | None = Field(
        default=None, max_length=256, description="Which image, when the input holds several."
    )
    canaries: Canaries = Field(default_factory=list, max_length=MAX_CANARIES, description=CANARIES_DOC)


class LayerStats(BaseModel):
    digest: str
    size: int
    fetched_bytes: int = 0
    read_bytes: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    fetch_wait_seconds: float = 0.0
    errors: int = 0


class ImageStats(BaseModel):
    name: str
    size: int
    fetched_bytes: int = Field(description="Bytes fetched from the repository on this node.")
    exposed_fraction: float = Field(description="fetched_bytes / size.")
    chunk_hit_rate: float | None = None
    fetch_wait_seconds: float = 0.0
    mode: Literal["lazy", "eager"]
    layers: list[LayerStats] = Field(default_factory=list)


class GcResult(BaseModel):
    images_deleted: int
    layers_deleted: int
    chunks_deleted: int
    bytes_freed: int
    kept_layers: int
    kept_chunks: int
    in_use: list[str]


class ImageList(BaseModel):
    images: list[ImageInfo]


class ErrorBody(BaseModel):
    code: str
    message: str
    detail: dict[str, object] = Field(default_factory=dict)


class ErrorResponse(BaseModel):
    error: ErrorBody


class Health(BaseModel):
    ok: bool
    version: str
    kinds: list[str]


ExecEvent.model_rebuild()


class BuildRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: BuildSpec
    args: Env = Field(default_factory=dict, description="Build arguments every step sees as env vars.")
    secrets: Env = Field(
        default_factory=dict,
        description="Secret arguments: seen only by steps that name them; never logged, cached by, or packed.",
    )
    canaries: Canaries = Field(default_factory=list, max_length=MAX_CANARIES, description=CANARIES_DOC)


MAX_DOCKERFILE = 1 << 20


class DockerfileBuildRequest(BaseModel):
    """A Dockerfile build: the file's text and its context (a tar uploaded to ``/v1/build-contexts``)."""

    model_config = ConfigDict(extra="forbid")

    name: ImageName = Field(description="repo:tag of the image to publish (docker build -t).")
    dockerfile: str = Field(min_length=1, max_length=MAX_DOCKERFILE, pattern=r"^[^\x00]*$")
    context: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="blake3 of the uploaded context tar (none: COPY and ADD have nothing to copy from).",
    )
    args: Env = Field(default_factory=dict, description="--build-arg values; a stage sees those it declares (ARG).")
    secrets: Env = Field(
        default_factory=dict,
        description="Secrets by id, for RUN --mount=type=secret,id=...; never logged, cached by, or packed.",
    )
    target: str | None = Field(
        default=None, pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$", description="The stage to build (default: the last)."
    )
    canaries: Canaries = Field(default_factory=list, max_length=MAX_CANARIES, description=CANARIES_DOC)


class BuildStepResult(BaseModel):
    index: int
    description: str
    cached: bool
    seconds: float
    layer: LayerInfo | None = None
    scrubbed: list[str] = Field(default_factory=list)


class BuildResult(BaseModel):
    image: ImageInfo
    steps: list[BuildStepResult]
    seconds: float


# ---- tenants and the audit log ---------------------------------------------------------------------------


class TenantCreate(_Strict):
    name: TenantName = Field(description="1-63 characters of a-z, 0-9 and '-'; never reused ('admin' is the operator).")


class TenantInfo(BaseModel):
    name: str
    created_at: datetime
    operator: bool = Field(description="The daemon's own token (STATE_DIR/token): sees and acts on everything.")
    revoked_at: datetime | None = Field(default=None, description="When the tenant was removed, if it was.")
    sandboxes: int = Field(0, description="Its live sandboxes.")


class TenantCreated(BaseModel):
    name: str
    token: str = Field(description="The tenant's bearer token: shown this once, only its hash is kept.")
    created_at: datetime


class TenantList(BaseModel):
    tenants: list[TenantInfo]


class TenantRemoved(BaseModel):
    name: str
    revoked_at: datetime
    killed: list[str] = Field(default_factory=list, description="Its sandboxes that were killed.")


class AuditRecord(BaseModel):
    time: datetime
    tenant: str | None = Field(description="None when the token was missing, wrong or revoked.")
    method: str
    route: str = Field(description="The route template, e.g. /v1/sandboxes/{sandbox_id}/exec.")
    sandbox: str | None = None
    status: int
    duration_ms: float
    command: str | None = Field(default=None, description="For execs: the command's first 256 bytes.")


class AuditList(BaseModel):
    records: list[AuditRecord] = Field(description="Oldest first: the newest `limit` that match.")
