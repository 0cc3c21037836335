"""The ``microvm`` kind: a QEMU micro-VM per sandbox, booted from the image's own layers.

The VM's disks are the image's EROFS layers (read-only; the lazily fetched file or the node's local
copy, the same bytes a container mounts) and a helper disk with the guest agent; the guest stacks
them with overlayfs over a tmpfs sized to the disk limit. Execs and files go through the agent on a
virtio-serial port. The host owns the timeouts: it kills the exec's tree through the agent, and the
VM itself when the agent stops answering. QEMU runs in a session of its own and outlives a daemon
restart; a restarted daemon re-attaches to the agent's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, ClassVar

from ...errors import BackendError, DsecError, InvalidRequest, KindUnavailable, SandboxGone
from ...images.store import ImageRef
from ...isolation import users
from ...isolation.network import addresses
from ...isolation.network.host import Attached
from ...proc import wait
from ...protocol.network import NetworkSpec
from ...protocol.sandbox import ExecRequest, ExecResult, FileEntry
from ...store.records import SandboxRecord
from ..base import BackendContext, OutputCallback
from ..execio import ExecIO
from ..network import PolicyNetwork
from . import accel, guest, jail, launcher_build, network, pack, qemu, snapshots, templates
from .agent_build import build_agent
from .channel import GuestChannel, connect_agent
from .files import GuestFiles
from .state import VMState

log = logging.getLogger("dsec.microvm")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A paused moment of one VM: its shape and its saved memory (the writable layer lives in it)."""

    spec: qemu.VMSpec
    memory: Path


BOOT_TIMEOUT = {"kvm": 30.0, "tcg": 120.0}
# Loading a saved memory image (tens of MB) takes well under a second; a restore still not answering QMP
# after this is stuck, and a create boots instead.
RESTORE_TIMEOUT = {"kvm": 15.0, "tcg": 30.0}
# Concurrent boots: software emulation needs a core per booting guest, and here (2 cores) 16 TCG boots at
# once livelocked and 2 beside a busy guest sometimes never finished; hardware virtualisation boots cheaply.
BOOTS = {"kvm": max(1, (os.cpu_count() or 1)), "tcg": max(1, (os.cpu_count() or 1) // 2)}
# A restore maps a saved memory image and runs on: cheap enough to run a few per core at once.
RESTORES = {"kvm": 4 * (os.cpu_count() or 1), "tcg": 2 * (os.cpu_count() or 1)}
VM_CACHE = Path(os.environ.get("DSEC_VM_CACHE", "/var/cache/dsec/vm"))
# Memory-snapshot templates: on by default; DSEC_VM_TEMPLATES=0 makes every VM boot cold.
TEMPLATES = os.environ.get("DSEC_VM_TEMPLATES", "1") != "0"


class MicroVMBackend(PolicyNetwork):
    kind: ClassVar[str] = "microvm"
    machine: ClassVar[str] = "microvm"
    guest_busybox: ClassVar[str | None] = "/.dsec/busybox"  # the helper disk's, read-only to the workload
    # the guest kernel has no 9p, virtiofsd is not on the node, and an ext4 image shared as a disk
    # cannot have a writer and readers in other kernels at once (docs/volumes.md)
    volumes_unsupported = "a VM's guest would need the volume shared into it (virtio-fs), which dsec does not do yet"
    keep_interface = True  # the tap is QEMU's: a lifted policy leaves it down and empty

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.vm_dir = ctx.state_dir / "vms"
        self.assets: guest.GuestAssets | None = None
        self.accel = "tcg"
        self._boots = asyncio.Semaphore(1)  # sized when the accelerator is known
        self._restores = asyncio.Semaphore(1)
        self._channels: dict[str, GuestChannel] = {}
        self._attach: dict[str, asyncio.Lock] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._exited: dict[str, str] = {}  # sandbox id -> why its QEMU is gone
        self._prepare_lock = asyncio.Lock()
        # per kind: each kind's guest assets differ, and pruning drops templates of other assets
        self.templates = ctx.state_dir / "vm-templates" / self.kind
        self._building: set[str] = set()
        self._template_gate = asyncio.Semaphore(1)
        self._template_pids: set[int] = set()
        # names of this node's template VMs: the state dir's hash tells them from other daemons'
        node = hashlib.sha256(str(ctx.state_dir.resolve()).encode()).hexdigest()[:8]
        self._template_prefix = f"tpl-{node}-"

    async def start(self) -> list[str]:
        if shutil.which(qemu.QEMU) is None:
            raise KindUnavailable(f"{qemu.QEMU} is not installed (apt-get install qemu-system-x86)")
        self.vm_dir.mkdir(parents=True, exist_ok=True)
        # templates saved by an older dsec sat directly in vm-templates/, before they went per kind
        for old in await asyncio.to_thread(lambda: list(self.templates.parent.glob("?" * 32))):
            await asyncio.to_thread(shutil.rmtree, old, True)
        # a template VM outlives a daemon stopped mid-build (QEMU has a session of its own): nothing
        # else will ever stop it
        for pid in await asyncio.to_thread(qemu.processes_named, f"dsec-{self._template_prefix}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                log.info("killed template VM %d left by an earlier daemon", pid)
        return [f"{self.kind} kind: QEMU {self.machine}; guest kernel, initramfs and accelerator probe on first use"]

    async def _prepare(self) -> guest.GuestAssets:
        """Guest kernel, initramfs, helper disk and the accelerator verdict: once, on the first create."""
        async with self._prepare_lock:
            if self.assets is None:
                await asyncio.to_thread(VM_CACHE.mkdir, parents=True, exist_ok=True)
                agent = await build_agent(VM_CACHE / "agent")
                await launcher_build.build_launcher()
                # what VMs of daemons that died left behind (once here, not on every QEMU start)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(jail.sweep)
                assets = await guest.prepare(VM_CACHE, agent)
                self.accel, why = await accel.choose(VM_CACHE, assets)
                log.info(
                    "%s kind: accelerator %s (%s), guest kernel %s", self.kind, self.accel, why, assets.kernel_version
                )
                self._boots = asyncio.Semaphore(BOOTS[self.accel])
                self._restores = asyncio.Semaphore(RESTORES[self.accel])
                self.assets = assets
                # templates of earlier guest assets can never be restored again
                await asyncio.to_thread(templates.prune, self.templates, self._asset_names())
            return self.assets

    async def close(self) -> None:
        for pid in list(self._template_pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _asset_names(self) -> list[str]:
        if self.assets is None:
            return []
        return [p.name for p in (self.assets.kernel, self.assets.initrd, self.assets.helper)]

    def _bundle(self, rec: SandboxRecord) -> Path:
        return self.vm_dir / rec.id

    def cgroup(self, rec: SandboxRecord) -> str | None:
        return f"{jail.CGROUP_PARENT}/{jail.key(rec.id, self._bundle(rec))}"

    def start_bound(self) -> int | None:
        return BOOTS[self.accel]

    def _spec(self, rec: SandboxRecord, image: ImageRef) -> qemu.VMSpec:
        if not image.layer_files:
            raise InvalidRequest(f"image {image.name} has no layer files to boot a VM from")
        memory_mib = qemu.memory_mib(rec.limits.memory)
        cpus = qemu.vcpus(rec.limits.cpu, rec.limits.cpu_limit)
        return self._vm_spec(rec, memory_mib, cpus, image.layer_files)

    def _vm_spec(self, rec: SandboxRecord, memory_mib: int, cpus: int, layers: tuple[Path, ...]) -> qemu.VMSpec:
        if self.assets is None:
            raise BackendError(f"{self.kind} backend used before start()")
        return qemu.VMSpec(
            name=rec.id,
            machine=self.machine,
            accel=self.accel,
            memory_mib=memory_mib,
            cpus=cpus,
            kernel=self.assets.kernel,
            initrd=self.assets.initrd,
            helper=self.assets.helper,
            layers=layers,
            disk_bytes=rec.limits.disk,
            bundle=self._bundle(rec),
            cpu_request=rec.limits.cpu,
        )

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        await self._prepare()
        spec = self._spec(rec, image)
        spec.bundle.mkdir(parents=True)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "TERM": "xterm",
            **image.env,
            **rec.env,
        }
        state = VMState(rec)
        state.env, state.cwd, state.user_spec = env, image.workdir or "/", image.user
        state.home_given = "HOME" in rec.env or "HOME" in image.env
        rec.accelerator = self.accel
        key = snapshots.template_key(spec, image.layer_digests)
        memory = self.templates / key / templates.MEMORY
        restore = TEMPLATES and await asyncio.to_thread(memory.exists)
        if restore:
            await asyncio.to_thread(templates.used, self.templates, key)
        try:
            chan = await self._launch(rec, spec, memory if restore else None)
        except BackendError as e:
            if not restore:
                raise
            # seen rarely here under load: a restoring QEMU that never answers QMP; a boot still works
            log.warning("sandbox %s: restoring template %s failed (%s); booting instead", rec.id, key[:12], e)
            await self._stop_vm(rec)
            restore = False
            chan = await self._launch(rec, spec, None)
        rec.started_from = "snapshot" if restore else "boot"
        if not restore:
            await self._settle(chan, spec)
        await self._prepare_guest(rec, chan, state.cwd)
        if TEMPLATES and not restore and key not in self._building:
            self._building.add(key)
            self._background(self._build_template(key, spec, image.layer_digests))
        if image.user not in ("", "root"):
            account = await self._account(rec, chan, image.user)
            if not account.is_root:
                state.user = (account.uid, account.gid)
                if "HOME" not in rec.env and "HOME" not in image.env:
                    env["HOME"] = account.home
        if rec.network is not None:
            await self._join_network(rec, rec.network)

    async def _prepare_guest(self, rec: SandboxRecord, chan: GuestChannel, cwd: str = "/") -> None:
        """``limits.pids`` for everything the sandbox runs (the guest's cgroup that holds every exec's own),
        and the image's working directory: one guest call."""
        argv = ["/.dsec/busybox", "sh", "-c", guest.PREPARE, "prepare", str(rec.limits.pids), cwd]
        status, _, err = await chan.run_bytes(argv, None, 30.0)
        if status != 0:
            raise BackendError(f"cannot prepare the guest (pids limit, {cwd}): {err.strip()[-300:]}")

    async def _launch(self, rec: SandboxRecord, spec: qemu.VMSpec, memory: Path | None) -> GuestChannel:
        """Start QEMU (booting, or restoring ``memory``) and wait for its agent. Boots and restores queue
        for separate slots, so restores never wait behind boots; the wait shows in the sandbox's info."""
        gate = self._restores if memory is not None else self._boots
        VMState(rec).shape = {
            "memory_mib": spec.memory_mib,
            "cpus": spec.cpus,
            "layers": [str(p) for p in spec.layers],
        }
        if gate.locked():
            rec.waiting = "a VM restore slot" if memory is not None else "a VM boot slot"
        async with gate:
            rec.waiting = None
            started = time.monotonic()
            pid = qemu.start(spec, incoming=memory)
            VMState(rec).pid = pid
            self._watch(rec.id, pid)
            try:
                if memory is not None:
                    await asyncio.to_thread(snapshots.resume_restored, spec.qmp_sock, RESTORE_TIMEOUT[self.accel])
                chan = await self._connect(rec, BOOT_TIMEOUT[self.accel], kick=memory is not None)
                if memory is not None:
                    clock, rng = await chan.refresh(10.0)
                    if not (clock and rng):
                        raise BackendError(f"the restored guest could not refresh (clock {clock}, rng {rng})")
            except (TimeoutError, DsecError, OSError) as e:
                why = self._exited.get(rec.id) or f"{type(e).__name__}: {e}"
                tail = qemu.console_tail(spec.bundle)
                qlog = qemu.log_tail(spec.bundle)
                raise BackendError(
                    f"the VM did not come up ({why}); QEMU said: {qlog[-600:] or '-'}; console ends with: {tail[-800:]}"
                ) from e
            VMState(rec).boot_took(time.monotonic() - started)
        return chan

    async def _settle(self, chan: GuestChannel, spec: qemu.VMSpec) -> None:
        """After a cold boot, before the VM is handed out or saved as a template: wait until the guest is
        ready beyond its agent answering. The microvm's agent is its init: nothing to wait for."""
        return None

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _build_template(self, key: str, like: qemu.VMSpec, layer_digests: tuple[str, ...]) -> None:
        """Boot a VM like ``like``, let it settle, save its memory as the template of ``key``; then new VMs
        of this shape restore instead of booting."""
        root = self.templates / key
        bundle = root / "build"
        name = f"{self._template_prefix}{key[:16]}"
        spec = dataclasses.replace(like, name=name, bundle=bundle)
        pid = None
        stop = asyncio.Event()
        try:
            await asyncio.to_thread(shutil.rmtree, bundle, True)
            await asyncio.to_thread(bundle.mkdir, parents=True)
            async with self._template_gate, self._boots:
                started = time.monotonic()
                pid = qemu.start(spec)
                self._template_pids.add(pid)
                # a console nobody reads stalls the guest's serial writes, and with them its boot
                self._background(qemu.drain_console(spec.console_sock, bundle / "console.log", stop))
                chan = await connect_agent(spec.agent_sock, BOOT_TIMEOUT[self.accel], lambda: None)
                try:
                    await self._settle(chan, spec)
                    # what a template saves is every non-zero page: drop the boot's caches and zero the
                    # free pages (a process fills them with zeros and exits), so restored VMs load and
                    # hold only what the guest uses
                    await chan.run(["/.dsec/busybox", "sh", "-c", templates.TRIM], {}, "/", None, 120.0, 4096)
                finally:
                    await chan.aclose()
                await asyncio.sleep(0.3)  # the agent notices the hangup: a restored one greets its new host
                size = await asyncio.to_thread(snapshots.save, spec.qmp_sock, root / templates.MEMORY)
            assets = self._asset_names()
            await asyncio.to_thread(templates.record, self.templates, key, assets, layer_digests)
            await asyncio.to_thread(templates.prune, self.templates, assets, keep=frozenset({key}))
            log.info(
                "template %s saved: %d MiB in %.1fs (layers %s)",
                key[:12],
                size >> 20,
                time.monotonic() - started,
                ",".join(d[:12] for d in layer_digests),
            )
        except (DsecError, OSError, TimeoutError) as e:
            log.warning("could not build VM template %s: %s", key[:12], e)
        finally:
            stop.set()
            if pid is not None and qemu.is_ours(pid, name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if pid is not None:
                with contextlib.suppress(ChildProcessError):
                    await wait(pid)
                self._template_pids.discard(pid)
            await asyncio.to_thread(qemu.release, name, bundle)
            await asyncio.to_thread(shutil.rmtree, bundle, True)

    def _watch(self, sandbox_id: str, pid: int) -> None:
        stop = self._stops[sandbox_id] = asyncio.Event()
        bundle = self.vm_dir / sandbox_id
        drain = asyncio.create_task(qemu.drain_console(bundle / "console.sock", bundle / "console.log", stop))

        async def reap() -> None:
            try:
                why = f"QEMU exited with status {await wait(pid)}"
            except ChildProcessError:  # adopted after a daemon restart: not our child, no status
                why = "QEMU exited"
            # the console's last lines (a panic's) arrive with its EOF, just after the exit
            with contextlib.suppress(Exception):  # a timeout, or the drain's own failure: the reason matters more
                await asyncio.wait_for(asyncio.shield(drain), 2.0)
            panic = await asyncio.to_thread(qemu.panic_line, bundle)
            if self._stops.get(sandbox_id) is stop:  # else the VM was stopped on purpose and forgotten
                self._exited.setdefault(sandbox_id, f"the guest kernel panicked ({panic})" if panic else why)
            stop.set()

        for task in (drain, asyncio.create_task(reap())):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, rec: SandboxRecord, timeout: float, kick: bool = False) -> GuestChannel:
        chan = await connect_agent(
            self._bundle(rec) / "agent.sock", timeout, lambda: self._exited.get(rec.id), kick=kick
        )
        self._channels[rec.id] = chan
        return chan

    async def _channel(self, rec: SandboxRecord) -> GuestChannel:
        chan = self._channels.get(rec.id)
        if chan is not None and not chan.closed:
            return chan
        async with self._attach.setdefault(rec.id, asyncio.Lock()):
            chan = self._channels.get(rec.id)
            if chan is not None and not chan.closed:
                return chan
            if not await self.alive(rec):
                raise SandboxGone(await self._why_gone(rec, f"the VM of sandbox {rec.id} is gone"))
            try:
                return await self._connect(rec, 10.0)
            except (TimeoutError, OSError) as e:
                raise SandboxGone(f"the guest agent of {rec.id} stopped answering: {e}") from e

    async def destroy(self, rec: SandboxRecord) -> None:
        await self._leave_network(rec)
        await self._stop_vm(rec)
        await asyncio.to_thread(shutil.rmtree, self._bundle(rec), True)

    async def _stop_vm(self, rec: SandboxRecord) -> None:
        """Kill the VM, forget what the backend held for it and release its jail; the bundle stays."""
        chan = self._channels.pop(rec.id, None)
        if chan is not None:
            await chan.aclose()
        pid = VMState(rec).pid
        if pid is not None and qemu.is_ours(pid, rec.id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                if not qemu.is_ours(pid, rec.id):
                    break
                await asyncio.sleep(0.02)
        stop = self._stops.pop(rec.id, None)
        if stop is not None:
            stop.set()
        self._attach.pop(rec.id, None)
        self._exited.pop(rec.id, None)
        if not await asyncio.to_thread(qemu.release, rec.id, self._bundle(rec)):
            log.warning("the VM of %s would not leave its cgroup", rec.id)

    async def alive(self, rec: SandboxRecord) -> bool:
        pid = VMState(rec).pid
        ok = pid is not None and rec.id not in self._exited and qemu.is_ours(pid, rec.id)
        if ok and pid is not None and rec.id not in self._stops:
            # a VM adopted after a daemon restart: a console nobody drains stalls the guest's writes
            self._watch(rec.id, pid)
        if ok:
            await self._adopt_network(rec)
        return ok

    # ---- network (see .network) --------------------------------------------------------------------

    async def _attach_network(self, rec: SandboxRecord, policy: NetworkSpec) -> Attached:
        return await self.net.attach_tap(rec.id, policy)

    async def _configure_sandbox_side(self, rec: SandboxRecord, attached: Attached) -> None:
        pair = addresses.Pair(attached.index)
        argv = network.guest_setup(pair.sandbox, pair.host, await self.net.resolver_address())
        status, _, err = await (await self._channel(rec)).run_bytes(argv, None, 30.0)
        if status != 0:
            await self._leave_network(rec)
            raise BackendError(f"the guest could not configure its network interface: {err.strip()[-300:]}")

    # ---- pause, resume, fork -----------------------------------------------------------------------

    def _spec_of(self, rec: SandboxRecord) -> qemu.VMSpec:
        """The VMSpec a running sandbox was started with (what a copy of it must match)."""
        shape = VMState(rec).shape
        if shape is None:
            raise BackendError(f"sandbox {rec.id} has no recorded VM shape (started by an older dsec?)")
        layers = tuple(Path(p) for p in shape["layers"])
        return self._vm_spec(rec, int(shape["memory_mib"]), int(shape["cpus"]), layers)

    async def _qmp(self, rec: SandboxRecord, command: str) -> Any:
        if not await self.alive(rec):
            raise SandboxGone(await self._why_gone(rec, f"the VM of sandbox {rec.id} is gone"))
        return await asyncio.to_thread(snapshots.command, self._bundle(rec) / "qmp.sock", command)

    async def pause(self, rec: SandboxRecord) -> None:
        await self._qmp(rec, "stop")

    async def resume(self, rec: SandboxRecord) -> None:
        await self._qmp(rec, "cont")
        await self._refresh(rec)

    async def _refresh(self, rec: SandboxRecord) -> None:
        """After the guest stood still: its clock to the host's, its CRNG reseeded."""
        clock, rng = await (await self._channel(rec)).refresh(10.0)
        if not (clock and rng):
            log.warning("sandbox %s could not refresh after a pause (clock %s, rng %s)", rec.id, clock, rng)

    @contextlib.asynccontextmanager
    async def checkpoint(self, rec: SandboxRecord) -> AsyncIterator[Checkpoint]:
        await self._prepare()
        spec = self._spec_of(rec)
        memory = self.vm_dir / f"fork-{rec.id}-{secrets.token_hex(4)}.mem"
        try:
            was_running = (await self._qmp(rec, "query-status")).get("status") == "running"
            started = time.monotonic()
            size = await asyncio.to_thread(snapshots.save, spec.qmp_sock, memory)
            log.info("sandbox %s: memory snapshot of %d MiB in %.2fs", rec.id, size >> 20, time.monotonic() - started)
            if was_running:
                await self._qmp(rec, "cont")
                await self._refresh(rec)
            yield Checkpoint(spec=spec, memory=memory)
        finally:
            await asyncio.to_thread(memory.unlink, True)

    async def restore(self, rec: SandboxRecord, parent: SandboxRecord, checkpoint: Any) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise BackendError(f"not a {self.kind} checkpoint: {checkpoint!r}")
        spec = dataclasses.replace(checkpoint.spec, name=rec.id, bundle=self._bundle(rec))
        await asyncio.to_thread(spec.bundle.mkdir, parents=True)
        VMState(rec).inherit(VMState(parent))
        rec.accelerator = parent.accelerator
        await self._prepare_guest(rec, await self._launch(rec, spec, checkpoint.memory))
        rec.started_from = "snapshot"
        if rec.network is not None:  # a rollback in place keeps its policy (a fork's copies have none)
            await self._join_network(rec, rec.network)

    async def keep_memory(self, rec: SandboxRecord, into: Path) -> None:
        async with self.checkpoint(rec) as saved:
            await asyncio.to_thread(os.link, saved.memory, into)  # the same file system: state_dir

    def kept(self, rec: SandboxRecord, memory: Path) -> Checkpoint:
        return Checkpoint(spec=self._spec_of(rec), memory=memory)

    @contextlib.asynccontextmanager
    async def frozen_upper(self, rec: SandboxRecord) -> AsyncIterator[Path]:
        chan = await self._channel(rec)
        # a tar of the layer: its bytes plus headers, generously bounded by the layer's own size limit
        limit = rec.limits.disk + rec.limits.disk // 4 + (64 << 20)
        async with pack.frozen_guest_upper(chan, self._bundle(rec) / "pack", limit) as upper:
            yield upper

    # ---- exec and files ----------------------------------------------------------------------------

    async def exec(
        self,
        rec: SandboxRecord,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        chan = await self._channel(rec)
        state = VMState(rec)
        user = state.user
        env = {**state.env, **req.env}
        if req.user is not None:
            account = await self._account(rec, chan, req.user)
            user = None if account.is_root else (account.uid, account.gid)
            env |= state.home_for(req.env, account.home)
        try:
            result = await chan.run(
                req.argv(),
                env=env,
                cwd=req.cwd or state.cwd,
                stdin=req.stdin.encode() if req.stdin is not None else None,
                timeout=req.timeout,
                output_limit=req.output_limit,
                on_output=on_output,
                user=user,
                idle_timeout=req.idle_timeout,
                rlimits=(rec.limits.nofile, rec.limits.fsize()),
                io=io,
            )
        except SandboxGone as e:
            raise SandboxGone(await self._why_gone(rec, str(e))) from e
        if result.timed_out and result.exit_code is None and result.signal is None:
            # the agent did not confirm the kill: the host's word is final, and the VM goes
            await self._kill_vm(rec, "the guest agent stopped answering after a timeout; the VM was killed")
            raise SandboxGone(self._exited[rec.id])
        return result

    async def _why_gone(self, rec: SandboxRecord, fallback: str) -> str:
        """The VM's own reason (QEMU's exit, a kernel panic) rather than the channel's: the channel
        usually sees the end a moment before QEMU is reaped."""
        stop = self._stops.get(rec.id)
        if stop is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 3.0)
        return self._exited.get(rec.id, fallback)

    async def _kill_vm(self, rec: SandboxRecord, why: str) -> None:
        self._exited[rec.id] = why
        pid = VMState(rec).pid
        if pid is not None and qemu.is_ours(pid, rec.id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _account(self, rec: SandboxRecord, chan: GuestChannel, spec: str) -> users.Account:
        if spec in ("", "root", "0", "0:0"):
            return users.ROOT
        texts = []
        for path in ("/etc/passwd", "/etc/group"):
            status, out, _ = await chan.run_bytes(["/.dsec/busybox", "cat", path], None, 30.0)
            texts.append(out.decode(errors="replace") if status == 0 else "")
        return users.resolve(spec, texts[0], texts[1])

    def _files(self, rec: SandboxRecord) -> GuestFiles:
        async def runner(argv: list[str], stdin: bytes | None, timeout: float) -> tuple[int, bytes, str]:
            chan = await self._channel(rec)
            return await chan.run_bytes(argv, stdin, timeout, user=VMState(rec).user)

        return GuestFiles(runner)

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        return await self._files(rec).read(path)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._files(rec).write(path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        return await self._files(rec).list(path)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        await self._files(rec).remove(path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        await self._files(rec).mkdir(path)

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        return await self._files(rec).stat(path)

    async def rename(self, rec: SandboxRecord, source: str, destination: str) -> None:
        await self._files(rec).move(source, destination)

    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        await self._files(rec).upload_tar(path, data)

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        return await self._files(rec).download_tar(path)
