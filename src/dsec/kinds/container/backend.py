"""Container sandboxes through crun (or runc): overlayfs root on a size-limited tmpfs upper layer.

Exec goes through the runtime's own ``exec``, so the daemon owns the pipes and the runtime reports the
exit status to the daemon: nothing the workload can overwrite reports a result. A read-only helper
mount (``/.dsec``: static busybox and catatonit from the host) holds the launcher of every exec. The
launcher tells the daemon its pid and waits until the daemon has moved it into a fresh per-exec
cgroup, so that a timeout kills exactly that exec's tree, including daemonised children.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from ...core.output import CappedBuffer
from ...errors import BackendError, InvalidRequest, LimitExceeded, SandboxGone
from ...images.store import ImageRef
from ...isolation import cgroups
from ...isolation.mounts import MS_NODEV, MS_NOSUID, mount, umount
from ...isolation.rootpath import RootFS, clean_path
from ...models import ExecRequest, ExecResult, FileEntry
from ...proc import read_fd, read_line, run, spawn, wait, write_all
from ...store.records import SandboxRecord
from ..base import MAX_ARCHIVE, MAX_FILE_READ, Backend, BackendContext, OutputCallback
from . import spec

log = logging.getLogger("dsec.container")

# Runs as /.dsec/busybox sh: report our pid on fd 4, wait for the go on fd 3, then become the command.
LAUNCH = 'echo $$ >&4; exec 4>&-; read -r _ <&3; exec 3<&-; exec "$@"'
HANDSHAKE_TIMEOUT = 30.0
# After the main process exits, how long to keep reading output that background children still write.
DRAIN_GRACE = 0.2


class ContainerBackend(Backend):
    kind = "container"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.runtime = shutil.which("crun") or shutil.which("runc") or ""
        self.runtime_name = os.path.basename(self.runtime) if self.runtime else "none"
        self.run_root = ctx.state_dir / "run" / self.runtime_name
        self.helper_dir = ctx.state_dir / "helpers"
        self.sandbox_dir = ctx.state_dir / "sandboxes"
        self.layout: cgroups.CgroupLayout | None = None
        self._seq = itertools.count(1)
        # exec cgroups with background processes outlive a daemon restart: names must not repeat
        self._boot = secrets.token_hex(3)

    # ---- host preparation --------------------------------------------------------------------------

    async def start(self) -> list[str]:
        if os.geteuid() != 0:
            raise BackendError("the container kind needs root (namespaces, cgroups, overlay mounts)")
        if not self.runtime:
            raise BackendError("no OCI runtime found: install crun (apt-get install crun) or runc")
        self.layout = cgroups.detect()
        notes = cgroups.prepare_host(self.layout)
        for d in (self.run_root, self.helper_dir, self.sandbox_dir):
            d.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._install_helpers)
        notes.append(f"container kind: runtime {self.runtime}, cgroups {self.layout.mode}")
        return notes

    def _install_helpers(self) -> None:
        """Static busybox and catatonit, copied so that a host package upgrade never changes a running sandbox."""
        for name in ("busybox", "catatonit"):
            src = shutil.which(name)
            if src is None:
                raise BackendError(f"{name} is not installed (apt-get install busybox-static catatonit)")
            dst = self.helper_dir / name
            if not dst.exists() or os.path.getsize(dst) != os.path.getsize(src):
                tmp = dst.with_suffix(".tmp")
                shutil.copy2(src, tmp)
                os.chmod(tmp, 0o555)
                tmp.rename(dst)

    def _layout(self) -> cgroups.CgroupLayout:
        if self.layout is None:
            raise BackendError("container backend used before start()")
        return self.layout

    def _bundle(self, rec: SandboxRecord) -> Path:
        return self.sandbox_dir / rec.id

    @staticmethod
    def _cg_path(rec: SandboxRecord) -> str:
        return f"/dsec/{rec.id}"

    def _runtime_argv(self, *args: str) -> list[str]:
        return [self.runtime, "--root", str(self.run_root), *args]

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        bundle = self._bundle(rec)
        rootfs, disk = bundle / "rootfs", bundle / "disk"
        rec.runtime = {"bundle": str(bundle), "cgroup": self._cg_path(rec), "runtime": self.runtime_name}
        try:
            await asyncio.to_thread(self._mount_rootfs, rec, image, rootfs, disk)
        except OSError as e:
            raise BackendError(f"cannot prepare the root filesystem: {e}") from e
        cfg = spec.config(rec, image, str(rootfs), str(self.helper_dir), self._cg_path(rec))
        (bundle / "config.json").write_text(json.dumps(cfg))
        status, out = await run(
            self._runtime_argv("run", "--detach", "--bundle", str(bundle), rec.id),
            timeout=60,
            log_file=str(bundle / "runtime.log"),
        )
        if status != 0:
            raise BackendError(f"{self.runtime_name} run failed ({status}): {out.decode(errors='replace')[-800:]}")

    def _mount_rootfs(self, rec: SandboxRecord, image: ImageRef, rootfs: Path, disk: Path) -> None:
        rootfs.mkdir(parents=True)
        disk.mkdir()
        # The writable layer lives on its own tmpfs: its size is the disk limit, its inode count bounded,
        # and its pages are charged to the memory cgroup of whoever writes them.
        inodes = max(16384, min(rec.limits.disk // 4096, 4 << 20))
        mount(
            "tmpfs",
            disk,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={rec.limits.disk},nr_inodes={inodes},mode=0755",
        )
        (disk / "upper").mkdir()
        (disk / "work").mkdir()
        lower = ":".join(str(p) for p in reversed(image.layers))
        mount("overlay", rootfs, "overlay", 0, f"lowerdir={lower},upperdir={disk}/upper,workdir={disk}/work")

    async def destroy(self, rec: SandboxRecord) -> None:
        layout = self._layout()
        if self.runtime:
            await run(self._runtime_argv("delete", "--force", rec.id), timeout=30)
        cg = layout.unified_dir(self._cg_path(rec))
        await asyncio.to_thread(self._cleanup, rec, cg)

    def _cleanup(self, rec: SandboxRecord, cg: Path) -> None:
        if cg.exists():
            cgroups.kill_group(cg)
            for _ in range(100):
                if cgroups.remove_group(cg):
                    break
                time.sleep(0.01)
        if self._layout().mode == "hybrid":
            for hier in cgroups.CGROUP_ROOT.iterdir():
                d = hier / "dsec" / rec.id
                if hier.name != "unified" and d.is_dir():
                    cgroups.remove_group(d)
        bundle = self._bundle(rec)
        for target in (bundle / "rootfs", bundle / "disk"):
            try:
                umount(target)
            except OSError:
                umount(target, lazy=True)
        shutil.rmtree(bundle, ignore_errors=True)

    async def alive(self, rec: SandboxRecord) -> bool:
        status, out = await run(self._runtime_argv("state", rec.id), timeout=10)
        if status != 0:
            return False
        try:
            state = json.loads(out)
        except ValueError:
            return False
        return bool(state.get("status") in ("running", "paused"))

    # ---- exec --------------------------------------------------------------------------------------

    async def exec(self, rec: SandboxRecord, req: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        stdin = req.stdin.encode() if req.stdin is not None else None
        env = {**req.env}
        return await self._exec(
            rec,
            req.argv(),
            stdin=stdin,
            timeout=req.timeout,
            cwd=req.cwd,
            env=env,
            limit=req.output_limit,
            on_output=on_output,
        )

    async def _exec(
        self,
        rec: SandboxRecord,
        argv: list[str],
        *,
        stdin: bytes | None,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        limit: int,
        on_output: OutputCallback | None = None,
        raw: list[bytearray] | None = None,
    ) -> ExecResult:
        layout = self._layout()
        cg_path = self._cg_path(rec)
        sandbox_cg = layout.unified_dir(cg_path)
        try:
            group = cgroups.make_exec_group(layout, cg_path, f"exec-{self._boot}-{next(self._seq)}")
        except FileNotFoundError:
            raise SandboxGone(f"sandbox {rec.id} is no longer running") from None
        cmd = self._runtime_argv("exec", "--preserve-fds=2", "--no-new-privs")
        if cwd:
            cmd += ["--cwd", cwd]
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        cmd += [rec.id, f"{spec.HELPER_MOUNT}/busybox", "sh", "-c", LAUNCH, "dsec-exec", *argv]

        fds: list[int] = []
        try:
            go_r, go_w = os.pipe()
            ready_r, ready_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            fds += [go_r, go_w, ready_r, ready_w, out_r, out_w, err_r, err_w]
            if stdin is not None:
                in_r, in_w = os.pipe()
                fds += [in_r, in_w]
            else:
                in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
                fds.append(in_r)
            oom_before = layout.oom_kills(cg_path)
            started = time.monotonic()
            pid = spawn(cmd, {0: in_r, 1: out_w, 2: err_w, 3: go_r, 4: ready_w})
        except OSError as e:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            cgroups.remove_group(group)
            raise BackendError(f"cannot start {self.runtime_name} exec: {e}") from e
        for fd in (in_r, out_w, err_w, go_r, ready_w):
            os.close(fd)

        caps = {"stdout": CappedBuffer(limit), "stderr": CappedBuffer(limit)}

        def sink(stream: str) -> OutputCallback | None:
            def feed(_: str, data: bytes) -> None:
                caps[stream].feed(data)
                if raw is not None and stream == "stdout":
                    raw[0] += data
                    if len(raw[0]) > MAX_ARCHIVE:
                        raise LimitExceeded(f"output exceeds {MAX_ARCHIVE} bytes")
                if on_output is not None:
                    on_output(stream, data)

            return feed

        feed_out, feed_err = sink("stdout"), sink("stderr")
        assert feed_out is not None and feed_err is not None
        readers = [
            asyncio.ensure_future(read_fd(out_r, lambda d: feed_out("stdout", d))),
            asyncio.ensure_future(read_fd(err_r, lambda d: feed_err("stderr", d))),
        ]
        writer = asyncio.ensure_future(write_all(in_w, stdin)) if stdin is not None and in_w >= 0 else None
        timed_out = False
        try:
            try:
                line = await asyncio.wait_for(read_line(ready_r), min(timeout, HANDSHAKE_TIMEOUT))
            except TimeoutError:
                line = b""
            finally:
                os.close(ready_r)
            if line.strip().isdigit():
                host_pid = cgroups.host_pid_for_nspid(sandbox_cg, int(line))
                if host_pid is not None:
                    with contextlib.suppress(OSError):
                        cgroups.move_pid(group, host_pid)
            with contextlib.suppress(OSError):
                os.write(go_w, b"\n")
            os.close(go_w)
            go_w = -1
            remaining = max(0.001, timeout - (time.monotonic() - started))
            try:
                status = await asyncio.wait_for(wait(pid), remaining)
            except TimeoutError:
                timed_out = True
                cgroups.kill_group(group)
                try:
                    status = await asyncio.wait_for(wait(pid), 10)
                except TimeoutError:
                    os.kill(pid, 9)
                    status = await wait(pid)
            duration = time.monotonic() - started
            _, pending = await asyncio.wait(readers, timeout=DRAIN_GRACE)
            for task in pending:
                task.cancel()
            for task in readers:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            if go_w >= 0:
                os.close(go_w)
            if writer is not None:
                writer.cancel()
            await asyncio.to_thread(cgroups.remove_group, group)

        code = status if status >= 0 else 128 - status
        oom = layout.oom_kills(cg_path) > oom_before
        signal = code - 128 if 128 < code <= 128 + 64 else None
        if not line.strip() and code != 0 and not await self.alive(rec):
            raise SandboxGone(f"sandbox {rec.id} is no longer running")
        return ExecResult(
            exit_code=code,
            signal=signal,
            stdout=caps["stdout"].text(),
            stderr=caps["stderr"].text(),
            truncated=caps["stdout"].truncated or caps["stderr"].truncated,
            stdout_bytes=caps["stdout"].total,
            stderr_bytes=caps["stderr"].total,
            timed_out=timed_out,
            oom_killed=oom,
            duration=duration,
        )

    # ---- files -------------------------------------------------------------------------------------

    def _fs(self, rec: SandboxRecord) -> RootFS:
        return RootFS(str(self._bundle(rec) / "rootfs"))

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        return await asyncio.to_thread(self._fs(rec).read, path, MAX_FILE_READ)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        await asyncio.to_thread(self._fs(rec).write, path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        return await asyncio.to_thread(self._fs(rec).list, path)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        await asyncio.to_thread(self._fs(rec).remove, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        await asyncio.to_thread(self._fs(rec).mkdir, path)

    # Archives are packed and unpacked by the helper busybox inside the sandbox's own namespaces, so
    # whatever a hostile archive names (absolute paths, .., links, devices) stays inside the sandbox.
    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        target = "/" + clean_path(path).lstrip(".")
        bb = f"{spec.HELPER_MOUNT}/busybox"
        script = f'{bb} mkdir -p "$1" && exec {bb} tar -x -o -f - -C "$1"'
        res = await self._exec(rec, [bb, "sh", "-c", script, "untar", target], stdin=data, timeout=600, limit=1 << 16)
        if res.exit_code != 0:
            raise InvalidRequest(f"cannot unpack the archive into {path}: {res.stderr.strip()[-500:]}")

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        target = "/" + clean_path(path).lstrip(".")
        bb = f"{spec.HELPER_MOUNT}/busybox"
        raw = [bytearray()]
        res = await self._exec(
            rec,
            [bb, "tar", "-c", "-f", "-", "-C", target, "."],
            stdin=None,
            timeout=600,
            limit=1 << 16,
            raw=raw,
        )
        if res.exit_code != 0:
            raise InvalidRequest(f"cannot archive {path}: {res.stderr.strip()[-500:]}")
        return bytes(raw[0])
