"""Test doubles: a sandbox kind that keeps everything in memory, and a fake built image on disk."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import posixpath
import tarfile
import time
from pathlib import Path

from dsec.errors import FileNotFoundInSandbox, InvalidRequest, SandboxGone
from dsec.images.model import ImageConfig
from dsec.images.scrub import ScrubRules
from dsec.images.store import ImageRef, ImageStore
from dsec.kinds.base import Backend, BackendContext, OutputCallback
from dsec.kinds.execio import ExecIO
from dsec.protocol.build import LayerRole
from dsec.protocol.sandbox import ExecRequest, ExecResult, FileEntry, ImageInfo
from dsec.protocol.terminal import PtySize
from dsec.store.records import SandboxRecord


class FakeBackend(Backend):
    """A container kind without containers.

    ``exec`` echoes the argv on stdout (or emits ``chunks`` when set) and exits with ``exit_code``;
    driven live (``io``), it runs as pid 100, 101, ... and behaves like ``cat``: every stdin chunk comes
    back on stdout until EOF; a signal ends it (``signals`` records them) as that signal would, and the
    sandbox's destruction with SandboxGone; one on a terminal (``io.pty``) takes resizes (``resizes``
    records them);
    files live in a dict per sandbox. ``create_error`` / ``destroy_error`` / ``exec_error`` make those
    calls raise; ``dead`` lists the ids ``alive`` reports as gone.
    """

    kind = "container"
    volumes_unsupported = None  # mounts nothing, but takes what the core grants (rec.volumes)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.exit_code = 0
        self.chunks: list[tuple[str, bytes]] | None = None
        self.create_error: BaseException | None = None
        self.destroy_error: BaseException | None = None
        self.exec_error: BaseException | None = None
        self.dead: set[str] = set()
        self.files: dict[str, dict[str, bytes]] = {}
        self.dirs: dict[str, set[str]] = {}
        self.created: list[str] = []
        self.destroyed: list[str] = []
        self.execs: list[ExecRequest] = []
        self.signals: list[tuple[int, int]] = []  # (pid, signal) of live execs
        self.resizes: list[tuple[int, PtySize]] = []  # (pid, size) of live execs on a terminal
        self._stopped: dict[str, asyncio.Future[None]] = {}  # sandbox id -> set when destroyed (live execs end)
        self.next_pid = 100
        self.images: dict[str, ImageRef] = {}
        self.started = False

    async def start(self) -> list[str]:
        self.started = True
        return ["fake backend ready"]

    # ---- lifecycle -----------------------------------------------------------------------------

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        if self.create_error is not None:
            raise self.create_error
        self.created.append(rec.id)
        self.images[rec.id] = image
        self.files[rec.id] = {}
        self.dirs[rec.id] = {"/"}
        rec.runtime["fake"] = True

    async def destroy(self, rec: SandboxRecord) -> None:
        self.destroyed.append(rec.id)
        stopped = self._stopped.pop(rec.id, None)
        if stopped is not None and not stopped.done():
            stopped.set_result(None)
        if self.destroy_error is not None:
            raise self.destroy_error
        self.files.pop(rec.id, None)
        self.dirs.pop(rec.id, None)

    async def alive(self, rec: SandboxRecord) -> bool:
        return rec.id not in self.dead

    async def exec(
        self,
        rec: SandboxRecord,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        self.execs.append(req)
        if self.exec_error is not None:
            raise self.exec_error
        if io is not None:
            stopped = self._stopped.setdefault(rec.id, asyncio.get_running_loop().create_future())
            return await self._live(req, on_output, io, stopped)
        chunks = self.chunks
        if chunks is None:
            chunks = [("stdout", (" ".join(req.argv()) + "\n").encode())]
        out = {"stdout": b"", "stderr": b""}
        for stream, data in chunks:
            out[stream] += data
            if on_output is not None:
                on_output(stream, data)
        return ExecResult(
            exit_code=self.exit_code,
            stdout=out["stdout"].decode(errors="replace"),
            stderr=out["stderr"].decode(errors="replace"),
            stdout_bytes=len(out["stdout"]),
            stderr_bytes=len(out["stderr"]),
        )

    async def _live(
        self, req: ExecRequest, on_output: OutputCallback | None, io: ExecIO, stopped: asyncio.Future[None]
    ) -> ExecResult:
        pid = self.next_pid
        self.next_pid += 1
        killed: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def signal(sig: int) -> None:
            self.signals.append((pid, sig))
            if not killed.done():
                killed.set_result(sig)

        def resize(size: PtySize) -> None:
            self.resizes.append((pid, size))

        io.attach(pid, signal, resize if io.pty is not None else None)
        out = b""
        started = time.monotonic()
        try:
            while True:
                chunk_task = asyncio.ensure_future(io.next_chunk())
                left = req.timeout - (time.monotonic() - started)
                waiting = {chunk_task, killed, stopped}
                done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if stopped in done:  # as a real kind's exec ends when its sandbox is destroyed
                    chunk_task.cancel()
                    raise SandboxGone("the fake sandbox stopped")
                if killed in done or not done:
                    chunk_task.cancel()
                    sig = killed.result() if killed.done() else 9
                    return ExecResult(exit_code=128 + sig, signal=sig, stdout=out.decode(), timed_out=not done)
                chunk = chunk_task.result()
                if chunk is None:
                    return ExecResult(exit_code=self.exit_code, stdout=out.decode(), stdout_bytes=len(out))
                out += chunk
                if on_output is not None:
                    on_output("stdout", chunk)
        finally:
            io.detach()

    # ---- files -----------------------------------------------------------------------------------

    @staticmethod
    def _norm(path: str) -> str:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        return posixpath.normpath(path).replace("//", "/")

    def _add_dirs(self, rec: SandboxRecord, path: str) -> None:
        dirs = self.dirs[rec.id]
        while path not in dirs:
            dirs.add(path)
            path = posixpath.dirname(path)

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        path = self._norm(path)
        if path in self.dirs[rec.id]:
            raise InvalidRequest(f"is a directory: {path}")
        try:
            return self.files[rec.id][path]
        except KeyError:
            raise FileNotFoundInSandbox(f"no such file or directory in the sandbox: {path}") from None

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        path = self._norm(path)
        self._add_dirs(rec, posixpath.dirname(path))
        self.files[rec.id][path] = bytes(data)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        path = self._norm(path)
        if path not in self.dirs[rec.id]:
            raise FileNotFoundInSandbox(f"no such directory in the sandbox: {path}")
        entries = [
            FileEntry(name=posixpath.basename(p), path=p, type="file", size=len(d), mode=0o644, mtime=0.0)
            for p, d in self.files[rec.id].items()
            if posixpath.dirname(p) == path
        ]
        entries += [
            FileEntry(name=posixpath.basename(p), path=p, type="dir", size=0, mode=0o755, mtime=0.0)
            for p in self.dirs[rec.id]
            if p != "/" and posixpath.dirname(p) == path
        ]
        return sorted(entries, key=lambda e: e.name)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        path = self._norm(path)
        files, dirs = self.files[rec.id], self.dirs[rec.id]
        if path in files:
            del files[path]
            return
        if path not in dirs:
            raise FileNotFoundInSandbox(f"no such file or directory in the sandbox: {path}")
        inside = [p for p in [*files, *dirs] if p.startswith(path + "/")]
        if inside and not recursive:
            raise InvalidRequest(f"directory not empty: {path}")
        for p in inside:
            files.pop(p, None)
            dirs.discard(p)
        dirs.discard(path)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        self._add_dirs(rec, self._norm(path))

    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        base = self._norm(path)
        self._add_dirs(rec, base)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    f = tar.extractfile(member)
                    assert f is not None
                    await self.write_file(rec, posixpath.join(base, member.name), f.read())

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        base = self._norm(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p, data in sorted(self.files[rec.id].items()):
                if p.startswith(base.rstrip("/") + "/"):
                    info = tarfile.TarInfo(posixpath.relpath(p, base))
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def make_image(
    images_root: Path,
    name: str = "test/img:1",
    env: dict[str, str] | None = None,
    workdir: str = "/",
    description: str = "a fake image for unit tests",
    files: dict[str, bytes] | None = None,
) -> ImageInfo:
    """Publish a one-layer image (a real EROFS layer in a real local repository) under ``images_root``."""

    async def publish() -> ImageInfo:
        store = ImageStore(images_root, lazy=False, mount=False)
        src = images_root / "tmp" / f"src-{time.monotonic_ns()}"
        for rel, data in (files or {"etc/hostname": b"sandbox\n"}).items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
        staged = await store.pack(src, ScrubRules())
        config = ImageConfig(env=env if env is not None else {"PATH": "/usr/bin:/bin"}, workdir=workdir)
        return await store.publish_layers(
            name, [(staged, LayerRole.base, "unit test")], config=config, description=description
        )

    # its own loop on its own thread, so that sync fixtures and async tests can both call it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, publish()).result()
