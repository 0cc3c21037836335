"""The function kind: sandboxes lent from warm pools of container workers, reset between users.

Creating a function sandbox takes a worker from the pool of its key (tenant, image version, limits,
network policy) instead of making a container; destroying it hands the worker back, to be reset and
verified in the background (reset.py) and lent again, or destroyed when the verification fails or the
use was hostile. A worker is a container sandbox made by this kind's own ContainerBackend, with the
same namespaces, seccomp profile, limits and network policy as any container; its record never
reaches the state database (only the function sandbox's does, naming its worker).

Workers are never shared between tenants: the tenant is part of the key. A sandbox that mounts named
volumes gets a worker made for it with those mounts, never pooled (it is destroyed when the sandbox ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

from ...errors import InvalidRequest, KindUnavailable, SandboxGone
from ...images.store import ImageRef
from ...protocol.checkpoints import CheckpointSupport
from ...protocol.network import NetworkSpec, describe
from ...protocol.run import PoolInfo
from ...protocol.sandbox import ExecRequest, ExecResult, FileEntry, Limits, NetworkStatus, State
from ...store.records import SandboxRecord, VolumeMount
from ...tenancy import OPERATOR
from ..base import Backend, BackendContext, FileWatch, OutputCallback
from ..container.backend import ContainerBackend
from ..execio import ExecIO
from . import reset
from .options import FunctionOptions
from .pool import Pool, PoolConfig, Pools
from .state import FunctionState, worker_record

log = logging.getLogger("dsec.function")

PREFIX = "fw-"
SHRINK_INTERVAL = 1.0
WORKER_TTL = 10 * 365 * 86400.0  # workers are not reaped by time; their pool shrinks them


@dataclass
class Worker:
    rec: SandboxRecord  # a container sandbox's record (kind "container"), held in memory only
    image: ImageRef
    clean: reset.Fingerprint | None = None
    before: reset.Counters | None = None  # the cgroup's events when the current use started
    uses: int = 0
    tainted: str | None = None  # why the current use was hostile
    lent_to: str | None = None  # the function sandbox using it
    denied: tuple[int, int] = (0, 0)  # the policy's counters when the current use started
    keep: str = ""  # the exec cgroup kept across uses (its first exec runs there)
    agent_pid: int = 0  # the worker's init, the sandbox agent (the only process a reset leaves)


class FunctionBackend(Backend):
    kind = "function"
    restackable = True
    keeps_metadata = True  # its worker container's
    volumes_unsupported = None  # on a worker made for the sandbox (create)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options.get("function")
        self.options = opts if isinstance(opts, FunctionOptions) else FunctionOptions()
        self.containers = ContainerBackend(ctx)
        self.pools: Pools[Worker] = Pools(self._make, self._reset, self._destroy_worker, self.options.config)
        self._lent: dict[str, Worker] = {}  # function sandbox id -> its worker
        self._images: dict[Hashable, ImageRef] = {}
        self._shrinker: asyncio.Task[None] | None = None

    # ---- daemon lifecycle --------------------------------------------------------------------------

    async def start(self) -> list[str]:
        notes = await self.containers.start()
        if self.containers.agent_error is not None:
            # reset and verification go through the agent, which must outlive its users
            raise KindUnavailable(f"the function kind needs the container sandbox agent: {self.containers.agent_error}")
        self._shrinker = asyncio.create_task(self._shrink_forever())
        cfg = self.pools.default
        return [
            *(n for n in notes if not n.startswith("container kind: runtime")),
            f"function kind: warm pools of container workers (at most {cfg.max_workers} per key, "
            f"idle ones above the minimum kept {cfg.idle_ttl:g}s, replaced after {cfg.max_uses} users)",
        ]

    async def close(self) -> None:
        if self._shrinker is not None:
            self._shrinker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shrinker
        await self.pools.close()
        await self.containers.close()

    async def release(self) -> None:
        await self.containers.release()

    async def _shrink_forever(self) -> None:
        while True:
            await asyncio.sleep(SHRINK_INTERVAL)
            try:
                await self.pools.shrink()
            except Exception:
                log.exception("shrinking the function pools failed")

    async def readopted(self) -> None:
        """Workers of a previous daemon that no re-adopted function sandbox uses (their pool is gone)."""
        live = {w.rec.id for w in self._lent.values()}
        for p in self.pools.pools.values():
            live |= {w.rec.id for w, _ in p.idle}
        for wid in reset.remove_stale(self.containers.sandbox_dir, live, PREFIX):
            log.info("removing function worker %s left by a previous daemon", wid)
            await self.containers.destroy(worker_record(wid))

    # ---- pools -------------------------------------------------------------------------------------

    @staticmethod
    def key(tenant: str, image: ImageRef, rec: SandboxRecord) -> tuple[str, str, str, str]:
        return (tenant, image.digest or image.name, rec.limits.model_dump_json(), describe(rec.network) or "")

    def pool_for(
        self, tenant: str, image: ImageRef, rec: SandboxRecord, config: PoolConfig | None = None
    ) -> Pool[Worker]:
        key = self.key(tenant, image, rec)
        self._images[key] = image
        label = f"{image.name} {rec.limits.memory >> 20}Mi/{rec.limits.cpu:g}cpu"
        if rec.network is not None:
            label += f" net={describe(rec.network)}"
        return self.pools.pool(key, tenant, label, config, template=(rec.limits, rec.network))

    async def _make(self, pool: Pool[Worker]) -> Worker:
        limits, network = pool.template
        return await self._new_worker(self._images[pool.key], limits, network, pool.tenant)

    async def _new_worker(
        self,
        image: ImageRef,
        limits: Limits,
        network: NetworkSpec,
        tenant: str,
        volumes: list[VolumeMount] | None = None,
    ) -> Worker:
        now = time.time()
        wrec = SandboxRecord(
            id=PREFIX + secrets.token_hex(6),
            kind="container",
            image=image.name,
            image_digest=image.digest,
            state=State.creating,
            created_at=now,
            expires_at=now + WORKER_TTL,
            limits=limits,
            owner=tenant,
        )
        wrec.network = network
        wrec.volumes = list(volumes or [])
        try:
            await self.containers.create(wrec, image, worker=True)
            pid = await self.containers.init_pid(wrec)
            if pid is None:
                raise SandboxGone("the worker's container stopped right after it started")
            wrec.state = State.running
            worker = Worker(rec=wrec, image=image, agent_pid=pid)
            group = self._group(worker)
            # the group every use's first exec runs in: made once, emptied by each reset
            worker.keep = self.containers.exec_group_name(wrec)
            await asyncio.to_thread((group / worker.keep).mkdir)
            layout, cg = self.containers.cgroup_layout(), self.containers.cgroup_path(wrec)
            worker.clean = await asyncio.to_thread(reset.fingerprint, layout, cg, self._upper(worker), pid)
            worker.before = await asyncio.to_thread(reset.counters, layout, cg)
            self.containers.run_next_exec_in(wrec, worker.keep)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.containers.destroy(wrec)
            raise
        return worker

    def _group(self, w: Worker) -> Path:
        layout = self.containers.cgroup_layout()
        return layout.unified_dir(self.containers.cgroup_path(w.rec))

    def _upper(self, w: Worker) -> Path:
        return self.containers.bundle_dir(w.rec) / "disk" / "upper"

    async def _reset(self, w: Worker) -> str | None:
        assert w.clean is not None and w.before is not None
        if not self.containers.agent_connected(w.rec):
            return "the worker's agent channel is closed"
        group, pid = self._group(w), w.agent_pid
        tmp = self.containers.bundle_dir(w.rec) / "disk" / "tmp"
        return await asyncio.to_thread(self._reset_on_host, group, tmp, pid, w)

    def _reset_on_host(self, group: Path, tmp: Path, pid: int, w: Worker) -> str | None:
        assert w.clean is not None and w.before is not None
        layout, cg = self.containers.cgroup_layout(), self.containers.cgroup_path(w.rec)
        why = reset.kill_users(group, pid, w.keep)
        if why is None:
            why = reset.wipe_and_verify(layout, cg, self._upper(w), tmp, pid, w.clean, w.before)
        if why is None:
            # the next use is measured from here: its own OOM kills and pid-limit hits only
            w.before = reset.counters(layout, cg)
            self.containers.run_next_exec_in(w.rec, w.keep)
        return why

    async def _destroy_worker(self, w: Worker) -> None:
        await self.containers.destroy(w.rec)

    async def prewarm(self, resolve: Callable[[str], Awaitable[ImageRef]]) -> list[str]:
        notes = []
        for p in self.options.prewarm:
            image = await resolve(p.image)
            now = time.time()
            template = SandboxRecord(
                id="",
                kind=self.kind,
                image=image.name,
                state=State.creating,
                created_at=now,
                expires_at=now,
                limits=Limits(),
                owner=OPERATOR.tenant,
            )
            config = dataclasses.replace(self.pools.default, min_idle=p.count)
            pool = self.pool_for(OPERATOR.tenant, image, template, config)
            self.pools.keep_warm(pool)
            notes.append(f"function kind: keeping {p.count} workers of {image.name} warm")
        return notes

    def pool_stats(self) -> list[PoolInfo]:
        return [
            PoolInfo(
                tenant=pool.tenant,
                image=pool.label,
                workers=pool.total,
                idle=len(pool.idle),
                lent=pool.lent,
                min_idle=pool.config.min_idle,
                max_workers=pool.config.max_workers,
                **dataclasses.asdict(pool.stats),
            )
            for pool in self.pools.pools.values()
        ]

    def images_in_use(self) -> set[str]:
        """Image versions held by workers (lent or idle): the image store must keep them."""
        used = {w.image.digest for w in self._lent.values()}
        for p in self.pools.pools.values():
            used |= {w.image.digest for w, _ in p.idle}
        return used

    # ---- lifecycle -----------------------------------------------------------------------------------

    def cgroup(self, rec: SandboxRecord) -> str | None:
        worker = self._lent.get(rec.id)
        return self.containers.cgroup(worker.rec) if worker is not None else None

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        if rec.volumes or image.stack:
            # a worker of its own, its mounts made for it, destroyed when the sandbox ends: a pooled worker's
            # mounts were made before any request named a volume or a checkpoint, and an idle one holds none
            worker = await self._new_worker(image, rec.limits, rec.network, rec.owner, rec.volumes)
            await self._lend(rec, worker, warm=False, key=("own", rec.id))
            return
        pool = self.pool_for(rec.owner, image, rec)
        worker, warm = await self.pools.acquire(pool)
        await self._lend(rec, worker, warm, self.key(rec.owner, image, rec))

    async def _lend(self, rec: SandboxRecord, worker: Worker, warm: bool, key: tuple[str, ...]) -> None:
        worker.uses += 1
        worker.tainted = None
        worker.lent_to = rec.id
        if worker.rec.network is not None:
            st = await self.containers.network_status(worker.rec)
            worker.denied = (st.denied_packets, st.denied_dns)
        self._lent[rec.id] = worker
        FunctionState(rec).lent(worker.rec, warm, key)

    async def destroy(self, rec: SandboxRecord) -> None:
        worker = self._lent.pop(rec.id, None)
        if worker is None:
            adopted = FunctionState(rec).adopted_worker(rec.limits)
            if adopted is not None:  # after a restart, never lent again: its pool is gone
                await self.containers.destroy(adopted)
            return
        worker.lent_to = None
        pool = self.pools.pools.get(FunctionState(rec).pool)
        if pool is None:
            await self._destroy_worker(worker)
            return
        self.pools.release(pool, worker, worker.tainted, worker.uses)

    async def alive(self, rec: SandboxRecord) -> bool:
        """After a daemon restart a lent worker keeps serving its sandbox, and is destroyed (not pooled)
        when that sandbox ends."""
        wrec = FunctionState(rec).adopted_worker(rec.limits)
        if wrec is None:
            return False
        wrec.volumes = list(rec.volumes)  # a worker made for a sandbox's volumes shows them at their paths
        if not await self.containers.alive(wrec):
            return False
        image = ImageRef(name=rec.image, layers=(), digest=rec.image_digest)
        self._lent[rec.id] = Worker(rec=wrec, image=image, tainted="re-adopted after a daemon restart")
        return True

    def default_user(self, rec: SandboxRecord) -> tuple[int, int] | None:
        worker = self._lent.get(rec.id)
        return self.containers.default_user(worker.rec) if worker is not None else None

    def lent_warm(self, rec: SandboxRecord) -> bool:
        return FunctionState(rec).warm

    def _worker(self, rec: SandboxRecord) -> Worker:
        worker = self._lent.get(rec.id)
        if worker is None:
            raise SandboxGone(f"sandbox {rec.id} has no worker")
        return worker

    # ---- operations: the worker's, marking hostile uses -------------------------------------------

    async def exec(
        self,
        rec: SandboxRecord,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        worker = self._worker(rec)
        try:
            res = await self.containers.exec(worker.rec, req, on_output, io)
        except SandboxGone:
            worker.tainted = "the worker stopped during a use"
            raise
        if res.oom_killed:
            worker.tainted = "a command was killed by the out-of-memory killer"
        elif res.timed_out:
            worker.tainted = "a command was killed by its timeout"
        return res

    def check_ports(self) -> None:
        pass

    async def connect_port(self, rec: SandboxRecord, port: int) -> socket.socket:
        sock = await self.containers.connect_port(self._worker(rec).rec, port)
        # closed with a reset, not a FIN: a TIME_WAIT left in the worker's namespace would fail its reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return sock

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        return await self.containers.read_file(self._worker(rec).rec, path)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.containers.write_file(self._worker(rec).rec, path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        return await self.containers.list_dir(self._worker(rec).rec, path)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        await self.containers.remove(self._worker(rec).rec, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        await self.containers.mkdir(self._worker(rec).rec, path)

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        return await self.containers.stat(self._worker(rec).rec, path)

    async def rename(self, rec: SandboxRecord, source: str, destination: str) -> None:
        await self.containers.rename(self._worker(rec).rec, source, destination)

    async def watch(self, rec: SandboxRecord, path: str, recursive: bool) -> FileWatch | None:
        return await self.containers.watch(self._worker(rec).rec, path, recursive)

    async def set_metadata(self, rec: SandboxRecord, path: str, metadata: dict[str, str]) -> None:
        await self.containers.set_metadata(self._worker(rec).rec, path, metadata)

    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        await self.containers.upload_tar(self._worker(rec).rec, path, data)

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        return await self.containers.download_tar(self._worker(rec).rec, path)

    def checkpoint_support(self) -> CheckpointSupport:
        why = self.containers.checkpoint_support().why
        return CheckpointSupport(files=True, processes=False, why=f"{why}; /tmp, a worker's scratch space, is not kept")

    @contextlib.asynccontextmanager
    async def frozen_upper(self, rec: SandboxRecord) -> AsyncIterator[Path]:
        async with self.containers.frozen_upper(self._worker(rec).rec) as upper:
            yield upper
        # the worker was frozen and thawed by the platform, not its user: still, a packed worker has a
        # written layer, which its reset will find and replace it for

    def check_network(self, policy: NetworkSpec) -> None:
        self.containers.check_network(policy)

    async def set_network(self, rec: SandboxRecord, policy: NetworkSpec) -> None:
        worker = self._worker(rec)
        await self.containers.set_network(worker.rec, policy)
        rec.network = policy
        # its pool's key names the policy it was made with: never lent to that pool again
        worker.tainted = "its network policy was changed during a use"

    async def network_status(self, rec: SandboxRecord) -> NetworkStatus:
        worker = self._worker(rec)
        st = await self.containers.network_status(worker.rec)
        # counted since this use began: earlier users' denied packets are not this one's business
        packets, dns = worker.denied
        return st.model_copy(
            update={"denied_packets": max(0, st.denied_packets - packets), "denied_dns": max(0, st.denied_dns - dns)}
        )

    def can_pause(self) -> bool:
        return False

    async def pause(self, rec: SandboxRecord) -> None:
        raise InvalidRequest("function sandboxes cannot be paused: they are lent for short uses")

    async def resume(self, rec: SandboxRecord) -> None:
        raise InvalidRequest("function sandboxes cannot be paused: they are lent for short uses")
