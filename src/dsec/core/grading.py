"""Grading that never trusts the candidate's copy of the grader (``sb.grade``, issue 5 item 6).

A candidate sandbox is where an agent worked; everything in it may have been rigged: its interpreter,
its shell, its site-packages hooks, its copy of the tests, its environment. So a grade runs elsewhere:

1. the candidate's listed ``paths`` (its work, never system directories) are read out of it through
   the platform's own archive path, and the archives cleaned: owners reset, set-id bits dropped, hard
   links made copies, devices and fifos dropped, and nothing kept below a symlink the archive itself
   carries (which could otherwise aim a later entry at /usr or /grade);
2. a fresh sibling sandbox of the same kind starts from the exact image version the candidate was
   created from (its digest, not the candidate's modified root), with the candidate's limits and no
   network, and with none of the image's or the candidate's environment;
3. the copies land at the same paths, the tests under /grade, all of it root-owned and not writable
   by anyone else (set up as root with the pristine image's own /bin/sh, chown and chmod);
4. ``cmd`` runs as uid/gid 65534 with exactly ``GRADE_ENV`` plus ``HOME`` (a fresh empty directory),
   so code the candidate wrote can read its files and the tests but not change them (EACCES);
5. the sibling is destroyed, whatever happened. The candidate is only read from.

The grade environment, and why each variable: ``PATH`` the platform default (images/model.py), so a
command name never resolves to the candidate's copy; ``LANG=C.UTF-8`` for stable text handling;
``PYTHONNOUSERSITE=1`` (no ~/.local site-packages), ``PYTHONDONTWRITEBYTECODE=1`` (no bytecode caches,
which the grading user could not write anyway), ``PYTHONSAFEPATH=1`` (the script's directory or the cwd
is not put first on sys.path, so a planted ``pytest.py`` next to the tests is not imported instead of
the real one). Absent on purpose: ``PYTHONPATH``, ``PYTHONSTARTUP``, ``PYTHONHOME``, ``LD_PRELOAD``,
``LD_LIBRARY_PATH``, ``BASH_ENV``, ``ENV`` and everything else the image or the candidate set. Graders
should still run Python as ``python3 -I`` (isolated: ignores every PYTHON* variable and user site).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import posixpath
import secrets
import tarfile
import time

from ..errors import BackendError, DsecError, FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from ..images.store import DEFAULT_PATH, ImageRef, ImageStore
from ..protocol.grade import GRADE_DIR, GradeRequest, GradeResult
from ..protocol.sandbox import CreateSandbox, ExecRequest
from ..store.records import SandboxRecord
from ..tenancy import OPERATOR, Caller
from .lifecycle import Lifecycle

log = logging.getLogger("dsec.grading")

GRADE_USER = "65534:65534"
GRADE_ENV = {
    "PATH": DEFAULT_PATH,
    "LANG": "C.UTF-8",
    "PYTHONNOUSERSITE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONSAFEPATH": "1",
}
MAX_COPY = 256 << 20  # bytes copied from the candidate, all paths together
MAX_COPY_ENTRIES = 200_000
SETUP_S = 300.0  # the sibling's time to live beyond the command's timeout
# Run as root in the sibling by the pristine image's /bin/sh: "$1" the fresh HOME, then the paths.
SETUP = """set -eu
home=$1; shift
for p in "$@"; do
  chown -R -h 0:0 -- "$p"
  chmod -R u=rwX,go=rX -- "$p"
done
mkdir -m 0700 -- "$home"
chown 65534:65534 -- "$home"
"""


def clean_archive(data: bytes) -> bytes:
    """The candidate's tar archive rebuilt with only what a read-only copy needs (see the module doc)."""
    out = io.BytesIO()
    links: set[str] = set()
    entries = 0
    try:
        src = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as e:
        raise BackendError(f"the candidate's archive is unreadable: {e}") from e
    with src, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            entries += 1
            if entries > MAX_COPY_ENTRIES:
                raise LimitExceeded(f"the candidate's files hold more than {MAX_COPY_ENTRIES} entries")
            name = posixpath.normpath(member.name.lstrip("/")) if member.name.strip("./") else "."
            parts = name.split("/")
            if name == "." or ".." in parts:
                continue
            if name in links or any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                continue  # at or below a symlink of the archive: it could point anywhere
            copy = tarfile.TarInfo(name)
            copy.mtime = member.mtime
            copy.mode = member.mode & 0o777
            if member.issym():
                copy.type, copy.linkname = tarfile.SYMTYPE, member.linkname
                links.add(name)
                dst.addfile(copy)
            elif member.isdir():
                copy.type = tarfile.DIRTYPE
                dst.addfile(copy)
            elif member.isfile() or member.islnk():
                body = src.extractfile(member)  # a hard link reads its target's data
                if body is None:
                    continue
                content = body.read()
                copy.type, copy.size = tarfile.REGTYPE, len(content)
                dst.addfile(copy, io.BytesIO(content))
    return out.getvalue()


@dataclasses.dataclass
class _Copy:
    path: str
    is_dir: bool
    data: bytes


class Grader:
    def __init__(self, lifecycle: Lifecycle, images: ImageStore) -> None:
        self.lifecycle = lifecycle
        self.sandboxes = lifecycle.sandboxes
        self.images = images

    async def grade(self, sandbox_id: str, req: GradeRequest, *, caller: Caller = OPERATOR) -> GradeResult:
        started = time.monotonic()
        rec, _ = self.sandboxes.running(sandbox_id, caller)
        image = await self._image(rec, req, caller)
        copies = await self._read_candidate(rec, req.paths)
        copied = sum(len(c.data) for c in copies)
        create = CreateSandbox(
            image=image.name,
            kind=rec.kind,
            limits=rec.limits,
            timeout=req.timeout + SETUP_S,
            env={},
            labels={"dsec.grade": rec.id},
            network=None,
        )
        t_create = time.monotonic()
        sibling: SandboxRecord | None = None
        try:
            sibling = await self.lifecycle.create_on(create, image, owner=rec.owner)
            t_copy = time.monotonic()
            home = await self._prepare(sibling, copies, req)
            t_run = time.monotonic()
            run = ExecRequest(
                cmd=req.cmd,
                timeout=req.timeout,
                cwd=req.cwd,
                env={**GRADE_ENV, "HOME": home},
                user=GRADE_USER,
                output_limit=req.output_limit,
            )
            result = await self.sandboxes.backends[sibling.kind].exec(sibling, run)
            t_done = time.monotonic()
        finally:
            if sibling is not None:
                with contextlib.suppress(DsecError):
                    await asyncio.shield(self.lifecycle.kill(sibling.id))
        log.info("graded %s in sibling %s: exit %s", rec.id, sibling.id, result.exit_code)
        return GradeResult(
            result=result,
            sandbox_id=sibling.id,
            image=image.name,
            image_digest=image.digest,
            copied_bytes=copied,
            create_seconds=round(t_copy - t_create, 3),
            copy_seconds=round(t_run - t_copy, 3),
            run_seconds=round(t_done - t_run, 3),
            seconds=round(time.monotonic() - started, 3),
        )

    async def _image(self, rec: SandboxRecord, req: GradeRequest, caller: Caller) -> ImageRef:
        """The pristine image: the exact version the candidate started from, with an environment of
        nothing but the platform's PATH (the grade sets the rest)."""
        images = self.images
        if req.image is not None:
            ref = await images.resolve(req.image, caller=caller)
        elif not rec.image_digest:
            ref = await images.resolve(rec.image, caller=caller)
        else:
            version = await images.catalog.version(rec.image_digest)
            digests = tuple(layer.digest for layer in version.layers)
            if images.mount:
                layers = tuple(await asyncio.gather(*(images.layers.mount(d) for d in digests)))
            else:
                layers = tuple(images.layers.blobs / d for d in digests)
            ref = ImageRef(
                name=rec.image,
                layers=layers,
                workdir=version.config.workdir,
                digest=rec.image_digest,
                layer_digests=digests,
                user=version.config.user,
                layer_files=tuple(images.layers.file(d) for d in digests),
            )
        return dataclasses.replace(ref, env={"PATH": DEFAULT_PATH})

    async def _read_candidate(self, rec: SandboxRecord, paths: list[str]) -> list[_Copy]:
        backend = self.sandboxes.backends[rec.kind]
        copies: list[_Copy] = []
        total = 0
        for path in paths:
            parent, name = posixpath.split(path)
            try:
                entries = await backend.list_dir(rec, parent)
            except FileNotFoundInSandbox:
                entries = []
            entry = next((e for e in entries if e.name == name), None)
            if entry is None:
                raise FileNotFoundInSandbox(f"{path} does not exist in sandbox {rec.id}", detail={"path": path})
            if entry.type == "dir":
                data = await asyncio.to_thread(
                    clean_archive, await self.sandboxes.checked(rec, backend.download_tar(rec, path))
                )
            elif entry.type == "file":
                data = await backend.read_file(rec, path)
            else:
                raise InvalidRequest(f"{path} in sandbox {rec.id} is a {entry.type}: give a directory or a file")
            total += len(data)
            if total > MAX_COPY:
                raise LimitExceeded(f"the candidate's paths hold more than {MAX_COPY} bytes to copy")
            copies.append(_Copy(path, entry.type == "dir", data))
        return copies

    async def _prepare(self, sibling: SandboxRecord, copies: list[_Copy], req: GradeRequest) -> str:
        """Copies and tests in place, root-owned and read-only to the grading user; returns its HOME."""
        backend = self.sandboxes.backends[sibling.kind]
        for c in copies:
            if c.is_dir:
                await backend.upload_tar(sibling, c.path, c.data)
            else:
                await backend.write_file(sibling, c.path, c.data, 0o644)
        await backend.mkdir(sibling, GRADE_DIR)
        for path, data in req.test_files().items():
            await backend.write_file(sibling, path, data, 0o644)
        home = f"/tmp/grade-home-{secrets.token_hex(6)}"
        setup = ExecRequest(
            cmd=["/bin/sh", "-c", SETUP, "grade-setup", home, GRADE_DIR, *(c.path for c in copies)],
            timeout=SETUP_S,
            env=GRADE_ENV,
            user="root",
        )
        res = await backend.exec(sibling, setup)
        if res.exit_code != 0:
            why = (res.stderr or res.stdout).strip()[-1000:]
            raise BackendError(f"preparing the grading sandbox failed (status {res.exit_code}): {why}")
        return home
