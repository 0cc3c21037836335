"""``dsec serve``: the node daemon's options, and what they become (the server's option objects).

Each option's declaration is a named type here (as ``UrlOpt`` in common.py): the command's signature
stays one line per option, and the declarations, the CLI's contract, stay together."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import DsecError, InvalidRequest
from .common import fail as _fail

if TYPE_CHECKING:
    from ..core.admission import AdmissionOptions
    from ..core.trajectory.recorder import TrajectoryOptions
    from ..daemon import ImageOptions
    from ..e2b.service import E2BOptions
    from ..fusion.service import FusionOptions
    from ..images.registry import RegistryOptions
    from ..isolation.network.options import NetworkOptions

StateDirOpt = Annotated[Path, typer.Option(help="Where state, images and sandboxes live.")]
ListenOpt = Annotated[
    str | None, typer.Option(help="unix:///path or http://127.0.0.1:PORT (default: STATE_DIR/dsec.sock).")
]
RepositoryOpt = Annotated[
    str | None,
    typer.Option(
        help="Layer repository: a directory (any shared file system mount) or s3://bucket/prefix?endpoint=URL "
        "(credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). Default: STATE_DIR/images/repository."
    ),
]
ImageCacheOpt = Annotated[
    str, typer.Option(help="Size cap of the node's cache of fetched layer chunks (LRU), e.g. 20G.")
]
ScrubOpt = Annotated[
    list[str] | None,
    typer.Option("--scrub", help="A residue rule (glob under /) for every layer this node packs (repeatable)."),
]
CanaryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--canary",
        help="A string no image published here may hold in any layer: publishes are refused (repeatable).",
    ),
]
EagerLayersOpt = Annotated[
    bool, typer.Option("--eager-layers", help="Fetch every layer whole before use instead of lazily.")
]
ResolveOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--resolve",
        help="NAME=IP: the platform resolver answers NAME with IP for sandboxes that may resolve it "
        "(repeatable; like curl's --resolve).",
    ),
]
RegistryAuthOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--registry-auth",
        help="HOST=USER:PASSWORD for a registry (repeatable), or the path of a Docker config.json to read "
        "instead of ~/.docker/config.json.",
    ),
]
RegistryMirrorOpt = Annotated[
    list[str] | None,
    typer.Option("--registry-mirror", help="REGISTRY=URL, tried before the registry (repeatable, in order)."),
]
RegistryInsecureOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--registry-insecure",
        help="A registry HOST[:PORT] or CIDR that may be spoken to in plain HTTP (loopback ones always may).",
    ),
]
RegistryAllowOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--registry-allow",
        help="A registry this node may pull from and push to (HOST or HOST:PORT; docker.io for Docker Hub; "
        "repeatable). "
        "Default: any. 'none': no registry at all.",
    ),
]
RegistryCaOpt = Annotated[
    list[str] | None, typer.Option("--registry-ca", help="HOST=PATH: a CA bundle for that registry (repeatable).")
]
FullDenyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--full-deny",
        help="A network (CIDR) sandboxes with network='full' do not reach (repeatable; default: the private "
        "ranges 10/8, 172.16/12, 192.168/16, 100.64/10, 198.18/15; 'none': no extra networks).",
    ),
]
AuditKeepDaysOpt = Annotated[float, typer.Option(min=0.001, help="Delete audit records older than this many days.")]
AuditMaxRecordsOpt = Annotated[
    int, typer.Option(min=1, help="Keep at most this many audit records (the newest; ~170 bytes each).")
]
FunctionPoolOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--function-pool",
        help="IMAGE=N: keep N function workers of IMAGE (default limits) warm from start (repeatable).",
    ),
]
WarmOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--warm",
        help="IMAGE\\[@KIND]\\[:LIMITS]=N: keep N idle sandboxes of IMAGE (KIND, default container; LIMITS as "
        "cpu=1,memory=512Mi) ready for the operator's creations that ask for exactly that (repeatable; "
        "docs/pools.md). Pools are named IMAGE-KIND ('dsec pool ls').",
    ),
]
FunctionMaxOpt = Annotated[
    int, typer.Option(min=1, max=4096, help="Function workers per pool (image, limits, network, tenant).")
]
FunctionIdleTtlOpt = Annotated[
    float, typer.Option(min=0.1, help="Seconds an idle function worker above its pool's minimum is kept.")
]
FunctionTenantMaxOpt = Annotated[
    int, typer.Option(min=1, help="Function workers one tenant may hold at once (all its pools).")
]
FunctionMaxUsesOpt = Annotated[
    int, typer.Option(min=1, help="Users a function worker serves before it is replaced anyway.")
]
TrajectoryDbOpt = Annotated[
    str | None,
    typer.Option(
        help="Where the trajectory log lives: sqlite:///PATH or postgresql://USER@HOST/DB (several nodes "
        "sharing one log). Default: trajectories.db in the state directory."
    ),
]
TrajectoryDurableOpt = Annotated[
    bool,
    typer.Option(
        help="SQLite: sync every commit of the trajectory log to disk (synchronous=FULL), so it survives "
        "a power loss too; by default it survives the daemon's crash, not the machine's."
    ),
]
TrajectoryKeepDaysOpt = Annotated[
    float, typer.Option(min=0.001, help="Delete trajectories not written to for this many days.")
]
NodeNameOpt = Annotated[
    str | None, typer.Option(help="This node's name in status, metrics and sandbox info (default: host name).")
]
CpuCapacityOpt = Annotated[
    float | None,
    typer.Option(min=0.01, help="Cores for sandboxes (default: the CPUs this daemon may run on)."),
]
MemoryCapacityOpt = Annotated[
    str | None,
    typer.Option(help="Memory for sandboxes, e.g. 20G (default: host memory minus 1 GiB and 5%)."),
]
CpuRatioOpt = Annotated[
    float, typer.Option(min=0.01, help="CPU oversubscription: CPU requests may add up to capacity x this.")
]
MemoryRatioOpt = Annotated[
    float, typer.Option(min=0.01, help="Memory oversubscription: memory requests may add up to capacity x this.")
]
QueueTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0,
        help="Seconds a creation beyond capacity waits in its tenant's queue before it is answered 429 "
        "with Retry-After (a creation may ask for another wait with queue_timeout).",
    ),
]
MaxQueueOpt = Annotated[
    int, typer.Option(min=0, help="Creations that may wait at once (all tenants); past it: 429 at once.")
]
EvictAtOpt = Annotated[
    float,
    typer.Option(
        min=0.1,
        max=1.0,
        help="Memory pressure (share of the node's memory in use) at which sandboxes furthest above "
        "their memory request are evicted, one per 2 s.",
    ),
]
E2BListenOpt = Annotated[
    str | None,
    typer.Option(
        help="Also serve the E2B-compatible API (control and in-sandbox) on http://HOST:PORT: set "
        "E2B_API_URL and E2B_SANDBOX_URL to it and E2B_API_KEY to a dsec token (docs/e2b.md)."
    ),
]
E2BImageOpt = Annotated[str, typer.Option(help="The image of E2B's default template, 'base'.")]
E2BKindOpt = Annotated[str, typer.Option(help="The kind of E2B sandboxes whose template and metadata name none.")]
E2BTemplateOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--e2b-template",
        help="NAME=IMAGE or NAME=IMAGE@KIND: an E2B template name for a dsec image (repeatable).",
    ),
]
E2BNetworkOpt = Annotated[
    str,
    typer.Option(
        help="Network of E2B sandboxes that ask for nothing: 'full' (E2B's default: the internet, not the "
        "host, private ranges or other sandboxes) or 'none' (loopback only)."
    ),
]
FusionListenOpt = Annotated[
    str | None,
    typer.Option(
        "--sandbox-fusion-listen",
        help="Also serve the SandboxFusion API (POST /run_code, as verl and the sandbox-fusion client call "
        "it) on http://HOST:PORT. It has no credentials, as SandboxFusion has none: bind it to loopback or a "
        "trusted network (docs/sandbox-fusion.md).",
    ),
]
FusionImageOpt = Annotated[
    str,
    typer.Option("--sandbox-fusion-image", help="The image SandboxFusion calls run in (every language's tools)."),
]
E2BDomainOpt = Annotated[
    str | None,
    typer.Option(
        help="E2B's sandbox domain: get_host(port) answers PORT-ID.DOMAIN, which must reach the E2B listener "
        "(wildcard DNS, or a Host header). Default: localhost:PORT of --e2b-listen."
    ),
]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning, error.")]


def serve(
    state_dir: StateDirOpt = Path("/var/lib/dsec"),
    listen: ListenOpt = None,
    repository: RepositoryOpt = None,
    image_cache: ImageCacheOpt = "20G",
    scrub: ScrubOpt = None,
    canary: CanaryOpt = None,
    eager_layers: EagerLayersOpt = False,
    registry_auth: RegistryAuthOpt = None,
    registry_mirror: RegistryMirrorOpt = None,
    registry_insecure: RegistryInsecureOpt = None,
    registry_ca: RegistryCaOpt = None,
    registry_allow: RegistryAllowOpt = None,
    resolve: ResolveOpt = None,
    full_deny: FullDenyOpt = None,
    audit_keep_days: AuditKeepDaysOpt = 90.0,
    audit_max_records: AuditMaxRecordsOpt = 1_000_000,
    warm: WarmOpt = None,
    function_pool: FunctionPoolOpt = None,
    function_max: FunctionMaxOpt = 64,
    function_idle_ttl: FunctionIdleTtlOpt = 60.0,
    function_tenant_max: FunctionTenantMaxOpt = 256,
    function_max_uses: FunctionMaxUsesOpt = 500,
    trajectory_db: TrajectoryDbOpt = None,
    trajectory_durable: TrajectoryDurableOpt = False,
    trajectory_keep_days: TrajectoryKeepDaysOpt = 30.0,
    node_name: NodeNameOpt = None,
    cpu_capacity: CpuCapacityOpt = None,
    memory_capacity: MemoryCapacityOpt = None,
    cpu_ratio: CpuRatioOpt = 8.0,
    memory_ratio: MemoryRatioOpt = 1.2,
    queue_timeout: QueueTimeoutOpt = 30.0,
    max_queue: MaxQueueOpt = 100_000,
    evict_at: EvictAtOpt = 0.95,
    e2b_listen: E2BListenOpt = None,
    e2b_image: E2BImageOpt = "dsec/debian:12",
    e2b_kind: E2BKindOpt = "container",
    e2b_template: E2BTemplateOpt = None,
    e2b_network: E2BNetworkOpt = "full",
    e2b_domain: E2BDomainOpt = None,
    sandbox_fusion_listen: FusionListenOpt = None,
    sandbox_fusion_image: FusionImageOpt = "dsec/code:1",
    log_level: LogLevelOpt = "info",
) -> None:
    """Run the node daemon."""
    from ..daemon import AuditOptions
    from ..daemon import serve as run_server
    from ..kinds.function.options import FunctionOptions
    from .pool import warm_specs

    try:
        options = _image_options(repository, image_cache, scrub, canary, eager_layers)
        options = dataclasses.replace(
            options,
            registry=_registry_options(registry_auth, registry_mirror, registry_insecure, registry_ca, registry_allow),
        )
        # bad entries fail here, not in the daemon's log
        network = _network_options(resolve, full_deny)
        audit = AuditOptions(keep_days=audit_keep_days, max_records=audit_max_records)
        function = FunctionOptions.of(
            function_pool or [], function_max, function_idle_ttl, function_tenant_max, function_max_uses
        )
        trajectory = _trajectory_options(trajectory_db, trajectory_durable, trajectory_keep_days)
        pools = warm_specs(warm or [])
        admission = _admission_options(
            cpu_capacity, memory_capacity, cpu_ratio, memory_ratio, queue_timeout, max_queue, node_name
        )
        # the other APIs the daemon serves, each on its own listener: (E2B's, SandboxFusion's)
        apis = (
            _e2b_options(e2b_listen, e2b_image, e2b_kind, e2b_template, e2b_network, e2b_domain),
            _fusion_options(sandbox_fusion_listen, sandbox_fusion_image),
        )
        args = (state_dir, listen, options, log_level, audit, network, function, trajectory, admission, evict_at)
        run_server(*args, *apis, warm=pools)
    except DsecError as e:
        _fail(e)


def _image_options(
    repository: str | None, image_cache: str, scrub: list[str] | None, canary: list[str] | None, eager_layers: bool
) -> ImageOptions:
    from ..daemon import ImageOptions
    from ..protocol.residue import check_canaries
    from ..units import parse_size

    try:
        cache_max = parse_size(image_cache)
    except ValueError as e:
        raise InvalidRequest(f"--image-cache: {e}") from None
    return ImageOptions(
        repository=repository,
        cache_max=cache_max,
        lazy=not eager_layers,
        scrub=tuple(scrub or ()),
        canaries=tuple(check_canaries(canary or ())),
    )


def _registry_options(
    auth: list[str] | None,
    mirrors: list[str] | None,
    insecure: list[str] | None,
    cas: list[str] | None,
    allow: list[str] | None,
) -> RegistryOptions:
    from ..images.registry import RegistryOptions

    credentials: dict[str, str] = {}
    docker_config: Path | None = None
    for entry in auth or ():
        host, eq, secret = entry.partition("=")
        if eq and ":" in secret and host.strip():
            credentials[host.strip()] = secret
        elif not eq and Path(entry).is_file():
            docker_config = Path(entry)
        else:
            raise InvalidRequest(
                f"--registry-auth {entry.split(':', 1)[0]!r}...: expected HOST=USER:PASSWORD or a file"
            )
    ca_files: dict[str, Path] = {}
    for entry in cas or ():
        host, eq, path = entry.partition("=")
        if not eq or not host.strip() or not Path(path).is_file():
            raise InvalidRequest(f"--registry-ca {entry!r}: expected HOST=PATH of a CA bundle that exists")
        ca_files[host.strip()] = Path(path)
    # bad mirrors and hosts fail here, not at the first pull
    return RegistryOptions(
        credentials=credentials,
        docker_config=docker_config,
        mirrors=tuple(mirrors or ()),
        insecure=tuple(insecure or ()),
        ca_files=ca_files,
        allowed=tuple(h for h in allow if h != "none") if allow else None,
    )


def _network_options(resolve: list[str] | None, full_deny: list[str] | None) -> NetworkOptions:
    from ..isolation.network.options import NetworkOptions, parse_full_deny
    from ..isolation.network.static import parse_resolve

    network = NetworkOptions(static=parse_resolve(resolve or []))
    if full_deny:
        network = dataclasses.replace(network, full_deny=parse_full_deny(full_deny))
    return network


def _trajectory_options(db: str | None, durable: bool, keep_days: float) -> TrajectoryOptions:
    from ..core.trajectory.recorder import TrajectoryOptions

    if db is not None and not db.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise InvalidRequest("--trajectory-db: use sqlite:///PATH or postgresql://USER@HOST/DB")
    return TrajectoryOptions(db, durable, keep_days)


def _admission_options(
    cpu_capacity: float | None,
    memory_capacity: str | None,
    cpu_ratio: float,
    memory_ratio: float,
    queue_timeout: float,
    max_queue: int,
    node_name: str | None,
) -> AdmissionOptions:
    from ..core.admission import AdmissionOptions
    from ..units import parse_size

    try:
        mem_cap = parse_size(memory_capacity) if memory_capacity is not None else None
    except ValueError as e:
        raise InvalidRequest(f"--memory-capacity: {e}") from None
    return AdmissionOptions(
        cpu_capacity=cpu_capacity,
        memory_capacity=mem_cap,
        cpu_ratio=cpu_ratio,
        memory_ratio=memory_ratio,
        queue_timeout=queue_timeout,
        max_queue=max_queue,
        node_name=node_name,
    )


def _e2b_options(
    listen: str | None, image: str, kind: str, template: list[str] | None, network: str, domain: str | None
) -> E2BOptions | None:
    if listen is None:
        return None
    from ..e2b.service import E2BOptions

    return E2BOptions.of(listen, image, kind, template or [], network, domain)


def _fusion_options(listen: str | None, image: str) -> FusionOptions | None:
    if listen is None:
        return None
    from ..fusion.service import FusionOptions

    return FusionOptions.of(listen, image)
