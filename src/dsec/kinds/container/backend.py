"""Container sandboxes through crun (or runc): overlayfs root on a size-limited tmpfs upper layer.

The container's init is dsec-agent (agent.c), started by the runtime with the sandbox's full
confinement and a socket to the daemon on fd 3; it starts each exec in ~1 ms. The daemon owns every
exec's pipes and puts every exec in its own cgroup, so a timeout kills exactly that exec's tree. A
read-only helper mount (``/.dsec``: the agent, static busybox, catatonit) holds what the platform runs
inside the sandbox, so the workload cannot replace it. When a sandbox has no agent channel, execs go
through the runtime's own ``exec`` instead (execution.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
import os
import random
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ...errors import BackendError, DsecError, KindUnavailable, SandboxGone, StorageFull
from ...images.store import ImageRef
from ...isolation import cgroups, seccomp, users
from ...isolation.mntns import MountNamespaces
from ...isolation.mounts import MS_NODEV, MS_NOSUID, is_mountpoint, mount, umount
from ...isolation.netns import connect_in_netns
from ...isolation.network.host import Attached
from ...isolation.rootpath import RootFS
from ...proc import run
from ...protocol.network import NetworkSpec
from ...protocol.sandbox import ExecRequest, ExecResult
from ...store.records import SandboxRecord
from ..base import BackendContext, OutputCallback, each_of
from ..execio import ExecIO
from ..network import PolicyNetwork
from . import agent, criu, spec
from .agent import AgentChannel
from .checkpointing import ContainerCheckpoints
from .execution import ExecPlan, run_via_agent, run_via_runtime
from .files import ContainerFiles
from .host import install_helpers, no_space, repair_host_devices
from .rootfs import SandboxRoots, bind_volumes, mount_rootfs
from .state import ContainerState

log = logging.getLogger("dsec.container")

AGENT_READY_TIMEOUT = 10.0
# names that only need to be unpredictable to a sandbox, not secret (getrandom is slow per call here)
_names = random.Random(secrets.randbits(128))


class ContainerBackend(ContainerCheckpoints, ContainerFiles, PolicyNetwork):
    kind = "container"
    restackable = True
    volumes_unsupported = None  # bound in at create (volumes.py)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.runtime = shutil.which("crun") or shutil.which("runc") or ""
        self.runtime_name = os.path.basename(self.runtime) if self.runtime else "none"
        self.run_root = ctx.state_dir / "run" / self.runtime_name
        self.helper_dir = ctx.state_dir / "helpers"
        self.sandbox_dir = ctx.state_dir / "sandboxes"
        self.layout: cgroups.CgroupLayout | None = None
        self.cgroup_hierarchies: list[str] = []
        self._seq = itertools.count(1)
        self.agent_error: str | None = None
        self.processes_error = "not probed yet"  # why checkpoints keep files only (criu.py)
        self.seccomp_bpf: str | None = None
        self.userns_error: str | None = None
        self.uid_slots = ctx.uid_slots
        self._userns_fds: dict[int, int] = {}
        self._channels: dict[str, AgentChannel] = {}
        self._next_roots = {}
        self._old_roots = {}
        self.roots = SandboxRoots(MountNamespaces.shared())
        self._attach_locks: dict[str, asyncio.Lock] = {}
        # exec cgroups with background processes outlive a daemon restart: names must not repeat
        self._boot = secrets.token_hex(3)

    # ---- host preparation --------------------------------------------------------------------------

    async def release(self) -> None:
        if await asyncio.to_thread(is_mountpoint, self.helper_dir):
            await asyncio.to_thread(umount, self.helper_dir, lazy=True)

    async def start(self) -> list[str]:
        if os.geteuid() != 0:
            raise KindUnavailable("the container kind needs root (namespaces, cgroups, overlay mounts)")
        if not self.runtime:
            raise KindUnavailable("no OCI runtime found: install crun (apt-get install crun) or runc")
        self.layout = cgroups.detect()
        notes = cgroups.prepare_host(self.layout)
        # a hybrid host's hierarchies, bound into each sandbox (spec._cgroup_or_scratch_mounts)
        self.cgroup_hierarchies = cgroups.hierarchies() if self.layout.mode == "hybrid" else []
        if self.layout.mode == "hybrid":
            try:
                cgroups.clone_cpusets(self.cgroup_path_root)
            except OSError as e:
                notes.append(f"container kind: new cpusets are not cloned from their parent ({e})")
        notes += repair_host_devices()
        for d in (self.run_root, self.helper_dir, self.sandbox_dir):
            d.mkdir(parents=True, exist_ok=True)
        if not is_mountpoint(self.helper_dir):
            # A file system of its own: a bind of a host directory shows that directory's host path in
            # the sandbox's /proc/self/mountinfo; the root of a tmpfs shows as "/".
            mount("dsec-helpers", self.helper_dir, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=0755")
        await asyncio.to_thread(install_helpers, self.helper_dir)
        try:
            await asyncio.to_thread(agent.build, self.helper_dir)
        except KindUnavailable as e:
            # Sandboxes still work without the agent, through the runtime's exec (~10 ms slower per exec).
            self.agent_error = str(e)
            notes.append(f"container kind: no sandbox agent ({e}); execs use {self.runtime_name} exec")
        if self.runtime_name == "crun":
            try:
                self.seccomp_bpf = await self._compile_seccomp()
            except (OSError, BackendError) as e:
                notes.append(f"container kind: seccomp profile not precompiled ({e}); crun compiles it per sandbox")
        if os.environ.get("DSEC_USERNS") == "0":
            self.userns_error = "disabled by DSEC_USERNS=0"
        else:
            try:
                await self._probe_userns()
            except OSError as e:
                self.userns_error = str(e)
                notes.append(f"container kind: no user namespaces ({e}); sandbox root is host root")
        if os.environ.get("DSEC_CONTAINER_EXEC") == "runtime":
            self.agent_error = "disabled by DSEC_CONTAINER_EXEC=runtime"
        self.processes_error = await criu.processes_unsupported()
        notes.append(
            f"container kind: runtime {self.runtime}, cgroups {self.layout.mode}, "
            f"exec via {'the sandbox agent' if self.agent_error is None else self.runtime_name + ' exec'}, "
            f"user namespaces {'on' if self.userns_error is None else 'off'}"
        )
        return notes

    async def _compile_seccomp(self) -> str:
        """The seccomp profile as crun compiles it, taken from a probe container's state (cached on disk)."""
        profile = json.dumps(seccomp.oci_profile(), sort_keys=True).encode()
        runtime_stamp = str(await asyncio.to_thread(os.path.getmtime, self.runtime)).encode()
        key = hashlib.sha256(profile + self.runtime.encode() + runtime_stamp)
        cached = self.helper_dir / f"seccomp-{key.hexdigest()[:16]}.bpf"
        if cached.exists():
            return base64.b64encode(cached.read_bytes()).decode()
        probe_id = f"dsec-seccomp-probe-{os.getpid()}"
        with tempfile.TemporaryDirectory(dir=self.ctx.state_dir) as tmp:
            bundle = Path(tmp)
            for sub in ("rootfs/dev", "rootfs/proc"):
                (bundle / sub).mkdir(parents=True)
            # never run (create stops before exec), but crun checks that it exists
            (bundle / "rootfs/probe").touch(mode=0o755)
            cfg = {
                "ociVersion": "1.0.2",
                "process": {"args": ["/probe"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
                "root": {"path": str(bundle / "rootfs")},
                "mounts": [],
                "linux": {"namespaces": [{"type": "mount"}, {"type": "pid"}], "seccomp": seccomp.oci_profile()},
            }
            (bundle / "config.json").write_text(json.dumps(cfg))
            try:
                status, out = await run(self._runtime_argv("create", "--bundle", str(bundle), probe_id), timeout=30)
                bpf = self.run_root / probe_id / "seccomp.bpf"
                if status != 0 or not bpf.exists():
                    raise BackendError(f"probe container failed: {out.decode(errors='replace')[-300:]}")
                data = bpf.read_bytes()
            finally:
                await run(self._runtime_argv("delete", "--force", probe_id), timeout=30)
        tmp_file = cached.with_suffix(".tmp")
        tmp_file.write_bytes(data)
        tmp_file.rename(cached)
        return base64.b64encode(data).decode()

    # ---- the host's view of a sandbox (the function kind resets its workers through these) ---------------

    def cgroup_layout(self) -> cgroups.CgroupLayout:
        if self.layout is None:
            raise BackendError("container backend used before start()")
        return self.layout

    def bundle_dir(self, rec: SandboxRecord) -> Path:
        """The sandbox's directory with its mounts: its root, its writable layer (disk/upper) and /tmp of a
        worker. A path under /proc when they are in a mount namespace of their own (rootfs.SandboxRoots)."""
        return self.roots.view(rec.id, self.sandbox_dir / rec.id)

    def agent_connected(self, rec: SandboxRecord) -> bool:
        chan = self._channels.get(rec.id)
        return chan is not None and not chan.closed

    def run_next_exec_in(self, rec: SandboxRecord, group: str) -> None:
        """The sandbox's next exec runs in ``group``, a cgroup already made under its own."""
        ContainerState(rec).ready(group)

    cgroup_path_root = "/dsec"

    @staticmethod
    def cgroup_path(rec: SandboxRecord) -> str:
        return f"/dsec/{rec.id}"

    def cgroup(self, rec: SandboxRecord) -> str | None:
        return self.cgroup_path(rec)

    def _runtime_argv(self, *args: str) -> list[str]:
        return [self.runtime, "--root", str(self.run_root), *args]

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def create(self, rec: SandboxRecord, image: ImageRef, *, worker: bool = False) -> None:
        """``worker``: a function worker, which serves one user after another (see ContainerState.worker)."""
        bundle = self.sandbox_dir / rec.id  # as the runtime sees it, from inside the sandbox's namespace
        rootfs = bundle / "rootfs"
        use_agent = self.agent_error is None
        # what later calls (and a restarted daemon) need and cannot derive from the id
        state = ContainerState(rec)
        if worker:
            state.mark_worker()
        state.init = "agent" if use_agent else "catatonit"
        state.env = spec.sandbox_env(rec, image)
        state.cwd = image.workdir or "/"
        began = time.monotonic()
        uid_base = None
        if self.userns_error is None:
            uid_base = state.uid_base = self.uid_slots.take()
        try:
            userns_fd = await self._userns_for(uid_base) if uid_base is not None else None

            def mounter() -> None:
                mount_rootfs(bundle, image.layers, rec.limits.disk, uid_base, userns_fd, worker, image.stack)
                bind_volumes(bundle, rec.volumes, userns_fd)

            # only the agent keeps the namespace's descriptor for a restarted daemon (rootfs.NS_FD)
            try:
                await self.roots.mount(rec.id, bundle, mounter, own_namespace=use_agent)
            finally:
                self._userns_done(uid_base)
        except OSError as e:
            raise BackendError(f"cannot prepare the root filesystem: {e}") from e
        account = await asyncio.to_thread(self._account, rec, image.user)
        state.home_given = "HOME" in rec.env or "HOME" in image.env
        rec.timings["rootfs"] = round(time.monotonic() - began, 6)  # the core's phase figures
        if not account.is_root:
            # the image's runtime account runs every exec and owns what the file API writes
            state.user = (account.uid, account.gid)
            if "HOME" not in rec.env and "HOME" not in image.env:
                state.env["HOME"] = account.home
        init = [f"{spec.HELPER_MOUNT}/agent"] if use_agent else [f"{spec.HELPER_MOUNT}/catatonit", "-P"]
        if not use_agent:
            # the init's stdio is the runtime's log file on the host; catatonit, unlike the agent, stays
            # dumpable, so the workload could write to it without bound through /proc/1/fd: give it none
            bb = f"{spec.HELPER_MOUNT}/busybox"
            init = [bb, "sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1', "dsec-init", *init]
        cfg = spec.config(
            rec,
            image,
            str(rootfs),
            str(self.helper_dir),
            self.cgroup_path(rec),
            init,
            self.seccomp_bpf,
            uid_base,
            cgroup_v2=self.cgroup_layout().mode == "v2",
            cgroup_hierarchies=self.cgroup_hierarchies,
        )
        await asyncio.to_thread((bundle / "config.json").write_text, json.dumps(cfg))
        await self._start_runtime(rec, bundle, use_agent)
        if rec.network is not None:
            await self._join_network(rec, rec.network)

    async def _start_runtime(self, rec: SandboxRecord, bundle: Path, use_agent: bool) -> None:
        """``crun run --detach`` from inside the sandbox's mount namespace; then wait for the agent's hello."""
        argv = self._runtime_argv("run", "--detach", "--bundle", str(bundle), rec.id)
        ours = theirs = None
        extra = self.roots.init_fds(rec.id)
        if use_agent:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            extra[3] = theirs.fileno()
            argv[-1:-1] = [f"--preserve-fds={len(extra)}"]
        try:
            log_file = str(bundle / "runtime.log")
            status, out = await run(
                argv, timeout=60, log_file=log_file, extra_fds=extra, start=self.roots.starter(rec.id)
            )
        finally:
            if theirs is not None:
                theirs.close()
        if status != 0:
            if ours is not None:
                ours.close()
            if status < 0:  # `run` gives a signal's death as its negative number
                raise BackendError(f"{self.runtime_name} was killed by signal {-status} while it created the sandbox")
            if no_space(bundle):  # its log is on that file system too: often all it could say is nothing
                raise StorageFull(f"{self.runtime_name} could not create the sandbox: no space left in {bundle.parent}")
            raise BackendError(f"{self.runtime_name} run failed ({status}): {out.decode(errors='replace')[-800:]}")
        if ours is not None:
            chan = AgentChannel(ours)
            try:
                await chan.wait_ready(AGENT_READY_TIMEOUT)
            except (TimeoutError, DsecError) as e:
                await chan.aclose()
                raise BackendError(f"the sandbox agent did not start: {e}") from e
            self._channels[rec.id] = chan
        pid = await asyncio.to_thread(self._recorded_pid, rec)
        if pid is not None:
            self.roots.settle(rec.id, pid)

    async def destroy(self, rec: SandboxRecord) -> None:
        layout = self.cgroup_layout()
        chan = self._channels.pop(rec.id, None)
        if chan is not None:
            await chan.aclose()
        self._attach_locks.pop(rec.id, None)
        self.forget_prepared(rec.id)
        cg = layout.unified_dir(self.cgroup_path(rec))
        # Killing the sandbox's cgroup ends every process of it, as `crun delete --force` would, without
        # starting crun (10-40 ms of a kill here); crun's record of it is only files then (_remove_files).
        # Without that cgroup (a creation that failed early) the runtime cleans up after itself.
        if not await asyncio.to_thread(self._kill_groups, rec, cg) and self.runtime:
            await run(self._runtime_argv("delete", "--force", rec.id), timeout=30)
        bundle = self.sandbox_dir / rec.id
        await each_of(  # its processes are gone: nothing keeps a mount busy
            self._leave_network(rec),
            asyncio.to_thread(self._remove_groups, rec, cg),
            self.roots.unmount(rec.id, bundle),
            asyncio.to_thread(self._remove_files, rec, bundle),
        )

    def _kill_groups(self, rec: SandboxRecord, cg: Path) -> bool:
        """Thaw and kill every process of the sandbox; False if it has no cgroup to do it through."""
        if not (cg / "cgroup.kill").exists():
            return False
        cgroups.thaw(self.cgroup_layout(), self.cgroup_path(rec))
        cgroups.kill_group(cg)
        return True

    def _remove_groups(self, rec: SandboxRecord, cg: Path) -> None:
        if cg.exists():
            cgroups.kill_group(cg)
            cgroups.remove_when_empty(cg)
        if self.cgroup_layout().mode == "hybrid":
            for hier in cgroups.CGROUP_ROOT.iterdir():
                d = hier / "dsec" / rec.id
                if hier.name != "unified" and d.is_dir():
                    cgroups.remove_group(d)

    def _remove_files(self, rec: SandboxRecord, bundle: Path) -> None:
        shutil.rmtree(bundle, ignore_errors=True)
        # the runtime's own record of the container (destroy did not ask it to delete, or its `delete`
        # failed on a full state file system): the container's processes are gone, so it is only files
        shutil.rmtree(self.run_root / rec.id, ignore_errors=True)
        base = ContainerState(rec).uid_base
        if base is not None:
            self.uid_slots.release(base)

    def _recorded_pid(self, rec: SandboxRecord) -> int | None:
        """The init's pid as the runtime recorded it (crun's status, runc's state.json): no process started."""
        for name, key in (("status", "pid"), ("state.json", "init_process_pid")):
            try:
                pid = json.loads((self.run_root / rec.id / name).read_bytes()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(pid, int) and pid > 0:
                return pid
        return None

    async def _running_state(self, rec: SandboxRecord) -> dict[str, object] | None:
        """The runtime's state of the container while it runs (or is paused); None otherwise."""
        status, out = await run(self._runtime_argv("state", rec.id), timeout=10)
        if status != 0:
            return None
        try:
            state = json.loads(out)
        except ValueError:
            return None
        running = isinstance(state, dict) and state.get("status") in ("running", "paused")
        return state if running else None

    async def alive(self, rec: SandboxRecord) -> bool:
        state = await self._running_state(rec)
        if state is None:
            return False
        base = ContainerState(rec).uid_base
        if base is not None:
            self.uid_slots.mark(base)  # re-adopted after a restart: its uid range stays taken
        pid = state.get("pid")
        if isinstance(pid, int) and pid > 0:
            await self.roots.adopt(rec.id, self.sandbox_dir / rec.id, pid)
        await self._adopt_network(rec)
        return True

    # ---- network -----------------------------------------------------------------------------------

    async def _attach_network(self, rec: SandboxRecord, policy: NetworkSpec) -> Attached:
        pid = await self.init_pid(rec)
        if pid is None:
            raise SandboxGone(f"sandbox {rec.id} is no longer running")
        return await self.net.attach(rec.id, pid, policy)

    async def _configure_sandbox_side(self, rec: SandboxRecord, attached: Attached) -> None:
        resolver = await self.net.resolver_address()
        base = ContainerState(rec).uid_base
        owner = (base, base) if base is not None else None
        fs = RootFS(str(self.bundle_dir(rec) / "rootfs"), owner=owner)
        await asyncio.to_thread(fs.write, "/etc/resolv.conf", f"nameserver {resolver}\n".encode(), 0o644)

    def check_ports(self) -> None:
        pass

    async def connect_port(self, rec: SandboxRecord, port: int) -> socket.socket:
        pid = await self.init_pid(rec)
        if pid is None:
            raise SandboxGone(f"sandbox {rec.id} is no longer running")
        return await connect_in_netns(pid, port)

    async def init_pid(self, rec: SandboxRecord) -> int | None:
        state = await self._running_state(rec)
        pid = state.get("pid") if state is not None else None
        return pid if isinstance(pid, int) and pid > 0 else None

    # ---- exec --------------------------------------------------------------------------------------

    async def exec(
        self,
        rec: SandboxRecord,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        stdin = req.stdin.encode() if req.stdin is not None else None
        state = ContainerState(rec)
        env = dict(req.env)
        if req.user is None:
            user = state.user
        else:
            account = await asyncio.to_thread(self._account, rec, req.user)
            user = None if account.is_root else (account.uid, account.gid)
            env |= state.home_for(env, account.home)
        plan = ExecPlan(
            argv=req.argv(),
            stdin=stdin,
            timeout=req.timeout,
            limit=req.output_limit,
            cwd=req.cwd,
            env=env,
            on_output=on_output,
            user=user,
            idle_timeout=req.idle_timeout,
            rlimits=(rec.limits.nofile, rec.limits.fsize()),
            io=io,
        )
        return await self._run(rec, plan)

    def _account(self, rec: SandboxRecord, user: str) -> users.Account:
        """A user spec resolved against the sandbox's own /etc/passwd and /etc/group."""
        if user in ("", "root", "0", "0:0"):
            return users.ROOT
        fs = RootFS(str(self.bundle_dir(rec) / "rootfs"))
        texts = []
        for path in ("/etc/passwd", "/etc/group"):
            try:
                texts.append(fs.read(path, 1 << 20).decode(errors="replace"))
            except DsecError:
                texts.append("")
        return users.resolve(user, texts[0], texts[1])

    async def _run(self, rec: SandboxRecord, plan: ExecPlan) -> ExecResult:
        layout = self.cgroup_layout()
        chan = await self._channel(rec)
        if chan is not None:
            # a function worker's first exec of a use runs in the group its reset left ready
            state = ContainerState(rec)
            ready = state.take_ready()
            return await run_via_agent(
                chan,
                layout,
                self.cgroup_path(rec),
                dict(state.env),
                state.cwd,
                plan,
                ready if ready is not None else self.exec_group_name(rec),
                reuse_group=ready is not None,
            )
        name = self.exec_group_name(rec)

        async def alive() -> bool:
            return await self.alive(rec)

        return await run_via_runtime(
            self._runtime_argv(),
            rec.id,
            layout,
            self.cgroup_path(rec),
            f"{spec.HELPER_MOUNT}/busybox",
            plan,
            name,
            alive,
        )

    def exec_group_name(self, rec: SandboxRecord) -> str:
        if ContainerState(rec).worker:
            # a function worker's next user sees its exec's cgroup name: a counter would tell it how
            # many commands ran before
            return f"exec-{_names.getrandbits(48):012x}"
        return f"exec-{self._boot}-{next(self._seq)}"

    async def _channel(self, rec: SandboxRecord) -> AgentChannel | None:
        """The sandbox's agent channel, re-attached after a daemon restart; None: use the runtime's exec."""
        if ContainerState(rec).init != "agent":
            return None
        chan = self._channels.get(rec.id)
        if chan is not None and not chan.closed:
            return chan
        lock = self._attach_locks.setdefault(rec.id, asyncio.Lock())
        async with lock:
            chan = self._channels.get(rec.id)
            if chan is not None and not chan.closed:
                return chan
            pid = await self.init_pid(rec)
            if pid is None:
                raise SandboxGone(f"sandbox {rec.id} is no longer running")
            chan = None
            try:
                chan = AgentChannel(agent.steal_parked_end(pid))
                await chan.hello()
            except (OSError, TimeoutError, DsecError) as e:
                if chan is not None:
                    await chan.aclose()
                log.warning("sandbox %s: cannot re-attach its agent (%s); using the runtime's exec", rec.id, e)
                ContainerState(rec).init = "agent-detached"
                return None
            self._channels[rec.id] = chan
            return chan

    async def pause(self, rec: SandboxRecord) -> None:
        await self._runtime_call(rec, "pause")

    async def resume(self, rec: SandboxRecord) -> None:
        await self._runtime_call(rec, "resume")

    async def _runtime_call(self, rec: SandboxRecord, action: str) -> None:
        """crun pause/resume: the cgroup freezer, every process of the container at once."""
        status, out = await run(self._runtime_argv(action, rec.id), timeout=30)
        if status != 0:
            if not await self.alive(rec):
                raise SandboxGone(f"the container of sandbox {rec.id} is gone")
            raise BackendError(f"cannot {action} sandbox {rec.id}: {out.decode(errors='replace')[-400:]}")
