"""The node's core, assembled: the sandbox state machine (sandboxes.py) and the parts that act through
it — the lifecycle, files, images, forks, grading, builds, one-shot runs, processes, the operation
table with the trajectory log wrapped around it, usage and metrics. ``SandboxManager`` builds and
starts them and is what the servers call; none of the parts knows it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..errors import DsecError, KindUnavailable
from ..images.builtin import RECIPES
from ..images.store import ImageRef, ImageStore
from ..isolation.network.host import NetworkHost
from ..isolation.network.options import NetworkOptions
from ..kinds import registry
from ..kinds.base import Backend, BackendContext, OutputCallback
from ..kinds.execio import ExecIO
from ..protocol.checkpoints import CheckpointInfo, CheckpointRequest, RollbackRequest
from ..protocol.grade import GradeRequest, GradeResult
from ..protocol.network import NetworkSpec
from ..protocol.node import NodeHistory, UsageSample, UsageSeries
from ..protocol.pools import WarmPoolInfo, WarmPoolSpec
from ..protocol.pull import PushRequest, PushResult
from ..protocol.sandbox import (
    TERMINAL_STATES,
    BuildResult,
    CreateSandbox,
    DockerfileBuildRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkRequest,
    ForkResult,
    GcResult,
    ImageInfo,
    NetworkStatus,
    SandboxInfo,
    SandboxList,
    SnapshotRequest,
)
from ..protocol.sandbox_query import SandboxQuery, select
from ..protocol.volumes import VolumeCreate, VolumeInfo
from ..store.audit import AuditLog
from ..store.records import SandboxRecord
from ..store.sqlite import SandboxStore
from ..store.tenants import TenantStore
from ..store.volumes import VolumeStore
from ..tenancy import OPERATOR, Caller
from .actions import Actions
from .admission import Admission, AdmissionOptions
from .builds import Builder
from .checkpoints import Checkpoints
from .code import CodeRunner
from .dockerfile.build import DockerfileBuild
from .exec_feed import Watcher
from .files import FileActions
from .grading import Grader
from .imageops import ImageActions
from .lifecycle import Kinds, Lifecycle
from .metrics import NodeMetrics
from .oneshot import Runner
from .ports import PortActions
from .processes import ProcessTable
from .record_writes import RecordWrites
from .sandboxes import Sandboxes
from .trajectory.recorder import Trajectories, TrajectoryOptions
from .usage import DEFAULT_EVICT_AT, UsageMonitor
from .volume_files import VolumeFiles
from .volumes import Volumes
from .warm import WarmPools

log = logging.getLogger("dsec.core")

REAP_INTERVAL = 1.0


class SandboxManager:
    def __init__(
        self,
        state_dir: Path,
        images: ImageStore | None = None,
        kinds: Sequence[str] | None = None,
        audit: AuditLog | None = None,
        network: NetworkOptions | None = None,
        kind_options: dict[str, Any] | None = None,
        trajectory: TrajectoryOptions | None = None,
        admission: AdmissionOptions | None = None,
        evict_at: float = DEFAULT_EVICT_AT,
    ) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.store = SandboxStore(state_dir / "state.db")
        self.records = RecordWrites(self.store)
        self.tenants = TenantStore(state_dir / "state.db")
        self.audit = audit or AuditLog(state_dir / "audit.db")
        self.images = images or ImageStore(state_dir / "images")
        self.ctx = BackendContext(state_dir=state_dir, net=NetworkHost(state_dir, network), options=kind_options or {})
        self.backends: dict[str, Backend] = {}
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}  # kind -> why this node cannot run it
        self.kinds = list(kinds) if kinds is not None else registry.available()  # the kinds to start
        self.admission = Admission(admission or AdmissionOptions(), quota_of=self.tenants.quota)
        self.node_name = self.admission.options.node_name or os.uname().nodename
        self.volumes = Volumes(state_dir / "volumes", VolumeStore(state_dir / "state.db"))
        self.volume_files = VolumeFiles(self.volumes)  # a volume's files with no sandbox (the E2B layer's)
        self.sandboxes = Sandboxes(self.store, self.records, self.admission, self.backends, self.volumes)
        self.metrics = NodeMetrics(self.sandboxes)
        self.lifecycle = Lifecycle(
            self.sandboxes,
            self.images,
            self.metrics,
            self.tenants,
            Kinds(self.unavailable, lambda kind: registry.load(kind, self.ctx)),
            self.node_name,
        )
        self.files = FileActions(self.sandboxes)
        self.checkpoints = Checkpoints(self.lifecycle, state_dir / "checkpoints")
        self.ports = PortActions(self.sandboxes)
        self.image_actions = ImageActions(self.sandboxes, self.images)
        self.grader = Grader(self.lifecycle, self.images)
        self.builds = Builder(self.lifecycle, self.images)
        for name, (_, dockerfile) in RECIPES.items():
            self.images.recipes[name] = functools.partial(self._build_recipe, name, dockerfile)
        self.runner = Runner(self.lifecycle, self.files)
        self.actions = Actions(self)
        self.trajectories = Trajectories(self.lifecycle, self, state_dir, trajectory)
        self.actions.recorder = self.trajectories
        self.processes = ProcessTable(self.sandboxes, self.actions)
        self.code = CodeRunner(self.actions, self.lifecycle, self.files)
        self.usage = UsageMonitor(self.sandboxes, self.lifecycle.evict, evict_at)
        self.warm = WarmPools(self.lifecycle)
        self._warm_at_start: dict[str, WarmPoolSpec] = {}  # dsec serve --warm: set once the kinds have started
        self.metrics.watch(self.usage, self.runner.pools, self.warm.list)
        self._reaper: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        # where the node also serves the E2B-compatible API, for its status (set by `dsec serve`)
        self.e2b_url: str | None = None

    def warm_at_start(self, pools: dict[str, WarmPoolSpec]) -> None:
        """Warm pools to set when the daemon has started (``dsec serve --warm``)."""
        self._warm_at_start.update(pools)

    @property
    def max_concurrent_creates(self) -> int:
        return self.lifecycle.max_concurrent_creates

    # ---- daemon lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await self.audit.start()
        self.notes += await self.images.start()
        if self.ctx.net is not None:
            await self.ctx.net.start()
            if self.ctx.net.error is not None:
                self.notes.append(f"no network policies on this node ({self.ctx.net.error}): loopback only")
        for kind in self.kinds:
            if kind in self.backends:  # injected (tests, embedding)
                continue
            try:
                backend = registry.load(kind, self.ctx)
                self.notes += await backend.start()
            except KindUnavailable as e:
                if kind == "container":
                    raise
                # a named prerequisite of an optional kind is missing (no QEMU, say): the others go on.
                # Anything else is a bug and stops the daemon: a kind quietly gone would hide it.
                self.unavailable[kind] = e.message
                self.notes.append(f"{kind} kind unavailable: {e.message}")
                continue
            self.backends[kind] = backend
        await self.lifecycle.readopt()
        if swept := await self.checkpoints.start():
            log.info("removed the checkpoints of %d sandbox(es) that ended while the daemon was down", swept)
        self.notes += await self.volumes.start()  # in-use counts rebuilt by the re-adoption
        await self.trajectories.start()
        for backend in self.backends.values():
            await backend.readopted()
            try:
                self.notes += await backend.prewarm(self.images.resolve)
            except DsecError as e:  # a pool that cannot be filled must not keep the node down
                self.notes.append(f"{backend.kind} kind: pre-warming failed: {e.message}")
        for name, spec in self._warm_at_start.items():
            try:
                self.warm.set(name, spec)
            except DsecError as e:  # a pool that cannot be kept must not keep the node down
                self.notes.append(f"warm pool {name}: {e.message}")
        self.warm.start()
        self._reaper = asyncio.create_task(self._reap_forever())
        self._monitor = asyncio.create_task(self.usage.run_forever())

    async def close(self) -> None:
        for task in (self._reaper, self._monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.warm.close()
        await self.sandboxes.settle(30)  # dead sandboxes' releases, traces being saved: bounded, then left
        await self.processes.close()
        for backend in self.backends.values():
            try:
                await backend.close()
            except Exception:
                log.exception("closing the %s kind failed", backend.kind)
        if self.ctx.net is not None:
            try:
                await self.ctx.net.close()
            except Exception:
                log.exception("closing the network side failed")
        survivors = sum(1 for r in self.sandboxes.live() if r.state not in TERMINAL_STATES)
        try:
            for note in await self.images.close(survivors):
                log.info("%s", note)
            if not survivors:  # what the kinds set up for their sandboxes (helpers, say) has no user left
                for backend in self.backends.values():
                    await backend.release()
        except (DsecError, OSError) as e:
            log.error("releasing the node's mounts: %s", e)
        await self.volumes.close()
        await self.trajectories.close()
        await self.audit.close()
        self.tenants.close()
        self.volumes.store.close()
        self.records.flush()
        self.store.close()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            try:
                await self.lifecycle.reap_once()
            except Exception:  # the reaper must survive anything one sandbox does
                log.exception("reaper pass failed")

    async def reap_once(self) -> None:
        await self.lifecycle.reap_once()

    # ---- sandboxes ---------------------------------------------------------------------------------

    async def create(self, req: CreateSandbox, *, caller: Caller = OPERATOR, persist: bool = True) -> SandboxInfo:
        """A new sandbox; with ``req.trajectory``, the trajectory's sandbox (new, resumed or rebuilt)."""
        if not req.trajectory:
            return await self.lifecycle.create(req, caller=caller, persist=persist)
        try:
            return await self.trajectories.create(req, caller)
        except DsecError as e:
            self.metrics.failed(req.kind, e.code, caller.owner)
            raise

    async def create_on(
        self, req: CreateSandbox, image: ImageRef, *, owner: str = OPERATOR.tenant, persist: bool = True
    ) -> SandboxRecord:
        return await self.lifecycle.create_on(req, image, owner=owner, persist=persist)

    def info(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return self.sandboxes.get(sandbox_id, caller).info()

    def usage_series(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> UsageSeries:
        self.sandboxes.get(sandbox_id, caller)
        samples = self.usage.series(sandbox_id)
        return UsageSeries(samples=[UsageSample(at=s.at, cpu_used=s.cpu_used, memory=s.memory) for s in samples])

    def history(self, *, caller: Caller = OPERATOR) -> NodeHistory:
        return self.metrics.history.view(caller)

    def watch_execs(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> AbstractContextManager[Watcher]:
        """The sandbox's commands as they run, from now on (its owner's or the operator's to watch)."""
        self.sandboxes.get(sandbox_id, caller)
        return self.lifecycle.feed.watch(sandbox_id)

    def record(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxRecord:
        """The sandbox's record, if ``caller`` may act on it (for layers that translate calls into the
        core's, like the E2B API: they need its owner and trajectory, not only its info)."""
        return self.sandboxes.get(sandbox_id, caller)

    def default_user(self, rec: SandboxRecord) -> tuple[int, int] | None:
        """The account (uid, gid) the sandbox's execs run as when they name none; None: root."""
        backend = self.backends.get(rec.kind)
        return backend.default_user(rec) if backend is not None else None

    def is_live(self, sandbox_id: str) -> bool:
        return self.sandboxes.is_live(sandbox_id)

    def list(
        self, labels: dict[str, str] | None = None, include_finished: bool = False, *, caller: Caller = OPERATOR
    ) -> builtins.list[SandboxInfo]:
        return [r.info() for r in self._listed(labels, include_finished, caller)]

    def list_page(
        self, q: SandboxQuery, labels: dict[str, str] | None = None, include_finished: bool = False, *, caller: Caller
    ) -> SandboxList:
        """The list as GET /v1/sandboxes's filters and page ask (infos made for the page only)."""
        return select(self._listed(labels, include_finished, caller), q, SandboxRecord.info)

    def _listed(
        self, labels: dict[str, str] | None, include_finished: bool, caller: Caller
    ) -> builtins.list[SandboxRecord]:
        live = sorted(self.sandboxes.live(), key=lambda r: r.created_at)
        recs = self.store.all() if include_finished else live
        wanted = labels or {}
        return [
            r
            for r in recs
            if r.pool is None and caller.owns(r.owner) and all(r.labels.get(k) == v for k, v in wanted.items())
        ]

    def live_count(self, tenant: str) -> int:
        return sum(1 for r in self.sandboxes.live() if r.owner == tenant and r.pool is None)

    # ---- warm pools ----------------------------------------------------------------------------------

    def warm_pools(self, *, caller: Caller = OPERATOR) -> builtins.list[WarmPoolInfo]:
        return self.warm.list(caller)

    def set_warm_pool(self, name: str, spec: WarmPoolSpec) -> WarmPoolInfo:
        return self.warm.set(name, spec)

    def remove_warm_pool(self, name: str) -> None:
        self.warm.remove(name)

    async def kill(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return await self.lifecycle.kill(sandbox_id, caller=caller)

    def set_timeout(self, sandbox_id: str, seconds: float, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return self.lifecycle.set_timeout(sandbox_id, seconds, caller=caller)

    async def evict(self, sandbox_id: str, reason: str) -> None:
        await self.lifecycle.evict(sandbox_id, reason)

    async def exec(
        self,
        sandbox_id: str,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        *,
        caller: Caller = OPERATOR,
        io: ExecIO | None = None,
    ) -> ExecResult:
        return await self.lifecycle.exec(sandbox_id, req, on_output, caller=caller, io=io)

    async def expire(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return await self.lifecycle.expire(sandbox_id, caller=caller)

    async def pause(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return await self.lifecycle.pause(sandbox_id, caller=caller)

    async def resume(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return await self.lifecycle.resume(sandbox_id, caller=caller)

    async def fork(self, sandbox_id: str, req: ForkRequest, *, caller: Caller = OPERATOR) -> ForkResult:
        """``req.n`` copies of a sandbox: a container's on its files (checkpoints.fork), a VM's restored
        from one memory snapshot of it (forks.fork)."""
        return await self.checkpoints.fork(sandbox_id, req, caller=caller)

    async def set_network(self, sandbox_id: str, policy: NetworkSpec, *, caller: Caller = OPERATOR) -> NetworkStatus:
        return await self.lifecycle.set_network(sandbox_id, policy, caller=caller)

    async def network_status(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> NetworkStatus:
        return await self.lifecycle.network_status(sandbox_id, caller=caller)

    async def remove_tenant(self, name: str) -> tuple[float, builtins.list[str]]:
        return await self.lifecycle.remove_tenant(name)

    # ---- files ---------------------------------------------------------------------------------------

    async def read_file(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        return await self.files.read_file(sandbox_id, path, caller=caller)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *, caller: Caller = OPERATOR
    ) -> None:
        await self.files.write_file(sandbox_id, path, data, mode, caller=caller)

    async def list_dir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> builtins.list[FileEntry]:
        return await self.files.list_dir(sandbox_id, path, caller=caller)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False, *, caller: Caller = OPERATOR) -> None:
        await self.files.remove(sandbox_id, path, recursive, caller=caller)

    async def mkdir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> None:
        await self.files.mkdir(sandbox_id, path, caller=caller)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, *, caller: Caller = OPERATOR) -> None:
        await self.files.upload_tar(sandbox_id, path, data, caller=caller)

    async def download_tar(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        return await self.files.download_tar(sandbox_id, path, caller=caller)

    async def stat(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> FileEntry:
        return await self.files.stat(sandbox_id, path, caller=caller)

    async def rename(self, sandbox_id: str, source: str, destination: str, *, caller: Caller = OPERATOR) -> None:
        await self.files.rename(sandbox_id, source, destination, caller=caller)

    async def set_metadata(
        self, sandbox_id: str, path: str, metadata: dict[str, str], *, caller: Caller = OPERATOR
    ) -> None:
        await self.files.set_metadata(sandbox_id, path, metadata, caller=caller)

    # ---- named volumes -------------------------------------------------------------------------------

    async def create_volume(self, req: VolumeCreate, *, caller: Caller = OPERATOR) -> VolumeInfo:
        return await self.volumes.create(req, caller)

    def list_volumes(self, *, caller: Caller = OPERATOR) -> builtins.list[VolumeInfo]:
        return self.volumes.list(caller)

    def volume(self, name: str, *, caller: Caller = OPERATOR) -> VolumeInfo:
        return self.volumes.info(name, caller)

    async def remove_volume(self, name: str, *, caller: Caller = OPERATOR) -> None:
        await self.volumes.remove(name, caller)

    # ---- checkpoints -------------------------------------------------------------------------------

    async def checkpoint(self, sandbox_id: str, req: CheckpointRequest, *, caller: Caller = OPERATOR) -> CheckpointInfo:
        return await self.checkpoints.take(sandbox_id, req, caller=caller)

    def list_checkpoints(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> builtins.list[CheckpointInfo]:
        return self.checkpoints.listed(sandbox_id, caller=caller)

    async def remove_checkpoint(self, sandbox_id: str, checkpoint: str, *, caller: Caller = OPERATOR) -> None:
        await self.checkpoints.remove(sandbox_id, checkpoint, caller=caller)

    async def rollback(self, sandbox_id: str, req: RollbackRequest, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return await self.checkpoints.rollback(sandbox_id, req, caller=caller)

    # ---- images and grading --------------------------------------------------------------------------

    def images_in_use(self) -> set[str]:
        return self.image_actions.images_in_use()

    async def snapshot(self, sandbox_id: str, req: SnapshotRequest, *, caller: Caller = OPERATOR) -> ImageInfo:
        return await self.image_actions.snapshot(sandbox_id, req, caller=caller)

    async def push_image(self, req: PushRequest, *, caller: Caller = OPERATOR) -> PushResult:
        return await self.image_actions.push(req, caller=caller)

    async def build_dockerfile(self, req: DockerfileBuildRequest, *, caller: Caller = OPERATOR) -> BuildResult:
        return await DockerfileBuild(self.builds, req, caller).run()

    async def _build_recipe(self, name: str, dockerfile: Path) -> None:
        """A built-in image that is a Dockerfile build of dsec's own (dsec/code:1), built by the operator."""
        text = await asyncio.to_thread(dockerfile.read_text)
        await DockerfileBuild(self.builds, DockerfileBuildRequest(name=name, dockerfile=text)).run()

    async def grade(self, sandbox_id: str, req: GradeRequest, *, caller: Caller = OPERATOR) -> GradeResult:
        """Run ``req.cmd`` in a fresh sibling of the candidate's pristine image against a read-only copy
        of its ``req.paths`` (core/grading.py). Allowed in: running; the candidate is only read from."""
        return await self.grader.grade(sandbox_id, req, caller=caller)

    async def remove_image(self, name: str, *, caller: Caller = OPERATOR) -> None:
        await self.image_actions.remove_image(name, caller=caller)

    async def gc_images(self) -> GcResult:
        return await self.image_actions.gc_images()
