"""The contract every sandbox kind implements. The core talks to kinds only through this ABC."""

from __future__ import annotations

import contextlib
import posixpath
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ..errors import FileNotFoundInSandbox, InvalidRequest
from ..images.store import ImageRef
from ..isolation.idmap import UidSlots
from ..isolation.network.host import NetworkHost
from ..protocol.checkpoints import CheckpointSupport
from ..protocol.network import NetworkSpec, describe
from ..protocol.run import PoolInfo
from ..protocol.sandbox import ExecRequest, ExecResult, FileEntry, NetworkStatus
from ..store.records import SandboxRecord
from .execio import ExecIO
from .port_relay import connect_by_exec
from .state import KindState

# Called with ("stdout" | "stderr", chunk) as output arrives, for streaming execs.
OutputCallback = Callable[[str, bytes], None]

MAX_FILE_READ = 256 << 20


async def each_of(*steps: Awaitable[object]) -> None:
    """Await every step in turn, going on past a failure (a teardown frees all it can), then raise the
    first failure."""
    failed: list[Exception] = []
    for step in steps:
        try:
            await step
        except Exception as e:
            failed.append(e)
    if failed:
        raise failed[0]


MAX_ARCHIVE = 512 << 20


class FileWatch(Protocol):
    """Change events of a directory as they happen (a kind's own watch; isolation/rootwatch.py)."""

    lost: bool  # some events were lost (a queue overflowed)

    def take(self) -> Sequence[tuple[str, str]]:
        """The events since the last take: (create|write|remove|rename|chmod, path under the directory)."""
        ...

    async def wait(self, timeout: float) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BackendContext:
    state_dir: Path
    net: NetworkHost | None = None  # the node's network side (ruleset, resolver); None: loopback only
    # host uid ranges taken by live sandboxes, shared by every kind that hands them out (container,
    # function): two sandboxes must never share a range
    uid_slots: UidSlots = field(default_factory=UidSlots)
    # per kind, the node's settings for it (``dsec serve``); a kind reads its own entry
    options: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Lifecycle and operations of one sandbox kind.

    Lifecycle methods are called by the core, which owns the state machine and has already checked
    that the sandbox is in a state that allows the call. Every method raises ``DsecError`` subclasses.
    """

    kind: ClassVar[str]
    # whether ``create`` mounts an image's ``stack`` (a checkpoint's layer files) itself: what
    # checkpoints, rollbacks and copies of the files need (core/checkpoints.py)
    restackable: ClassVar[bool] = False
    # why the kind cannot mount named volumes (None: it can)
    volumes_unsupported: ClassVar[str | None] = "this kind does not mount them"
    guest_busybox: ClassVar[str | None] = None  # a busybox in the sandbox: its nc reaches exposed ports
    keeps_metadata: ClassVar[bool] = False  # whether set_metadata keeps a file's user metadata

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    async def start(self) -> list[str]:
        """Check and prepare the host once at daemon start; returns notes for the log."""
        return []

    def cgroup(self, rec: SandboxRecord) -> str | None:
        """The cgroup (path under the hierarchy roots) that holds everything the sandbox runs, for its
        usage figures; None if the kind has none of its own."""
        return None

    def default_user(self, rec: SandboxRecord) -> tuple[int, int] | None:
        """The account (uid, gid) an exec that names none runs as; None: root."""
        return KindState(rec).user

    def lent_warm(self, rec: SandboxRecord) -> bool:
        """Handed out ready-made from a warm pool (a one-shot run's result says so)."""
        return False

    def start_bound(self) -> int | None:
        """How many sandboxes of this kind boot at once, if the kind bounds it itself (VM kinds), for status."""
        return None

    async def readopted(self) -> None:
        """Called once after the daemon re-adopted the sandboxes of a previous run (``alive``)."""
        return None

    async def prewarm(self, resolve: Callable[[str], Awaitable[ImageRef]]) -> list[str]:
        """Fill the kind's warm pools configured at daemon start; returns notes for the log."""
        return []

    def pool_stats(self) -> list[PoolInfo]:
        """The kind's warm pools, if it keeps any."""
        return []

    def images_in_use(self) -> set[str]:
        """Image versions the kind holds beyond its live sandboxes' own (warm pools)."""
        return set()

    async def close(self) -> None:
        """The daemon is stopping: end the kind's own background work (sandboxes themselves live on)."""
        return None

    async def release(self) -> None:
        """The daemon has stopped with no sandbox left on the node: undo what the kind set up on the host
        for its sandboxes (its own mounts), so nothing of dsec stays behind. Called after ``close``."""
        return None

    @abstractmethod
    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        """Make the sandbox run; may keep what later calls need in its state view of ``rec.runtime`` (persisted)."""

    @abstractmethod
    async def destroy(self, rec: SandboxRecord) -> None:
        """Stop the sandbox and free everything it held; idempotent, also for half-created sandboxes."""

    @abstractmethod
    async def alive(self, rec: SandboxRecord) -> bool:
        """Whether the sandbox still runs (used to re-adopt sandboxes after a daemon restart)."""

    @abstractmethod
    async def exec(
        self,
        rec: SandboxRecord,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run a command; the exit status is observed on the host side.

        With ``io`` (the request's ``stdin`` is then None) the command's standard input is what the
        caller feeds while it runs, and the kind reports the command's pid and a way to signal its
        tree (``io.attach``) once it started, and ``io.detach()`` when it ended."""

    @abstractmethod
    async def read_file(self, rec: SandboxRecord, path: str) -> bytes: ...

    @abstractmethod
    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None: ...

    @abstractmethod
    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]: ...

    @abstractmethod
    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None: ...

    @abstractmethod
    async def mkdir(self, rec: SandboxRecord, path: str) -> None: ...

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        """The entry at ``path`` itself (a symlink is not followed). This default lists the parent."""
        clean = posixpath.normpath(path) if path.startswith("/") else path
        if clean == "/":
            return FileEntry(name="/", path="/", type="dir", size=0, mode=0o755, mtime=0.0)
        parent, name = posixpath.split(clean)
        for entry in await self.list_dir(rec, parent or "/"):
            if entry.name == name:
                return entry
        raise FileNotFoundInSandbox(f"no such file or directory in the sandbox: {path}")

    async def rename(self, rec: SandboxRecord, source: str, destination: str) -> None:
        """rename(2) of ``source`` to ``destination`` (parents of the destination are made)."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot rename files yet")

    async def watch(self, rec: SandboxRecord, path: str, recursive: bool) -> FileWatch | None:
        """Events of the directory at ``path`` as they happen; None: the kind has no such watch, and the
        core looks at the directory again and again instead (core/watch.py)."""
        return None

    async def set_metadata(self, rec: SandboxRecord, path: str, metadata: dict[str, str]) -> None:
        """The file's user metadata becomes exactly ``metadata`` (``FileEntry.metadata``); a kind that
        keeps none takes only an empty one."""
        if metadata:
            raise InvalidRequest(f"sandboxes of kind {self.kind!r} keep no file metadata")

    @abstractmethod
    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        """Unpack a tar archive into directory ``path`` (created if missing)."""

    @abstractmethod
    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        """A tar archive of directory ``path``."""

    def frozen_upper(self, rec: SandboxRecord) -> contextlib.AbstractAsyncContextManager[Path]:
        """The sandbox's writable layer in overlayfs format, ids as the sandbox sees them, while every
        process in it is frozen (pack_diff). Kinds that cannot snapshot yet keep this default."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be snapshotted yet")

    def check_volumes(self, volumes: Mapping[str, object]) -> None:
        """Refuse named volumes this kind cannot mount, before anything is made. A kind that mounts them
        finds them in ``rec.volumes`` at ``create``: each volume's host mount, to show at its path."""
        if volumes and self.volumes_unsupported is not None:
            raise InvalidRequest(
                f"named volumes are not supported for {self.kind} sandboxes: {self.volumes_unsupported}; "
                "use kind='container' or 'function'"
            )

    def check_ports(self) -> None:
        """Refuse exposing ports on a kind that has no way to its sandboxes' loopback."""
        if self.guest_busybox is None:
            raise InvalidRequest(f"ports of {self.kind} sandboxes cannot be exposed")

    async def connect_port(self, rec: SandboxRecord, port: int) -> socket.socket:
        """A connected, non-blocking socket to ``port`` on the sandbox's loopback (``PortUnreachable``
        when nothing listens there). This default, for sandboxes the host cannot enter, runs the
        connection through a command in the sandbox (port_relay.py)."""
        self.check_ports()
        assert self.guest_busybox is not None
        return await connect_by_exec(lambda req, cb, io: self.exec(rec, req, cb, io), self.guest_busybox, port)

    def check_network(self, policy: NetworkSpec) -> None:
        """Refuse a network policy this kind cannot enforce, before anything is made."""
        if policy is not None:
            raise InvalidRequest(
                f"network policy {describe(policy)!r} is not supported for kind {self.kind!r}: its sandboxes "
                "have no network interface (network=None only)"
            )

    async def set_network(self, rec: SandboxRecord, policy: NetworkSpec) -> None:
        """Enforce ``policy`` on a running sandbox from now on (and record it in ``rec``)."""
        self.check_network(policy)
        rec.network = policy

    async def network_status(self, rec: SandboxRecord) -> NetworkStatus:
        return NetworkStatus(policy=rec.network)

    def can_pause(self) -> bool:
        """Whether the kind pauses sandboxes (it overrides pause)."""
        return type(self).pause is not Backend.pause

    async def pause(self, rec: SandboxRecord) -> None:
        """Stop every process of the sandbox where it stands (a VM's vCPUs; a container's cgroup)."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be paused")

    async def resume(self, rec: SandboxRecord) -> None:
        """Let a paused sandbox run on."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be paused")

    reroots: ClassVar[bool] = False  # whether ``reroot`` can do it (for some sandboxes of the kind)

    async def reroot(self, rec: SandboxRecord, image: ImageRef) -> bool:
        """Roll back in place where the kind can: end every process but the sandbox's init and put
        ``image``'s root filesystem under it, keeping the init, network and cgroups. False: not done
        (the core stops the sandbox and creates it again on ``image``)."""
        return False

    def prepare_reroot(self, rec: SandboxRecord, image: ImageRef) -> None:
        """A hint that ``reroot`` onto ``image`` may come next (a checkpoint was taken, or the sandbox
        was rolled back to it): a kind may make that root ready in the background. Never fails."""
        return None

    def checkpoint_support(self) -> CheckpointSupport:
        """What a checkpoint (and a copy) of this kind's sandboxes captures on this node."""
        if self.forks_memory:
            return CheckpointSupport(files=True, processes=True)
        return CheckpointSupport(files=False, processes=False, why=f"not built yet for kind {self.kind!r}")

    @property
    def forks_memory(self) -> bool:
        """Whether its copies and checkpoints carry memory and processes (a VM's saved memory holds its
        files too): then ``checkpoint``, ``restore``, ``keep_memory`` and ``kept`` are the kind's own."""
        return type(self).checkpoint is not Backend.checkpoint

    def checkpoint(self, rec: SandboxRecord) -> contextlib.AbstractAsyncContextManager[Any]:
        """A memory snapshot of the whole sandbox (fork), valid inside the context; the sandbox is left
        as it was (running or paused) once the snapshot is taken."""
        raise InvalidRequest(
            f"sandboxes of kind {self.kind!r} cannot be forked: fork restores a memory snapshot, which only VM "
            "kinds (microvm, vm) take; snapshot() the sandbox and create new ones from that image instead"
        )

    async def restore(self, rec: SandboxRecord, parent: SandboxRecord, checkpoint: Any) -> None:
        """Make ``rec`` run as a copy of ``parent`` at the moment ``checkpoint`` was taken (``rec`` may be
        ``parent`` itself, stopped: a rollback in place)."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be forked")

    async def keep_memory(self, rec: SandboxRecord, into: Path) -> None:
        """Save the whole sandbox, memory and processes with its files, as the file ``into`` (a kept
        checkpoint: core/checkpoints.py), leaving it running as it was."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be saved with their memory")

    def kept(self, rec: SandboxRecord, memory: Path) -> Any:
        """The checkpoint ``restore`` takes for a memory ``keep_memory`` saved from ``rec``."""
        raise InvalidRequest(f"sandboxes of kind {self.kind!r} cannot be saved with their memory")
