"""E2B template builds run by dsec's Dockerfile builder: the uploads their COPY steps take (by the
SDK's files hash, per owner), the base they start from, the build itself as a task of the daemon, and
its log, which the SDK polls (``logsOffset``) while it waits.

A build is what any dsec image build is (core/builds.py): each step in a fresh builder sandbox, root
inside it with the internet but not the host, the daemon, metadata or other sandboxes; each layer
scrubbed and cached per tenant; the result an immutable image owned by the template's owner.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import logging
import os
import posixpath
import re
import tarfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from ..core.dockerfile.build import DockerfileBuild
from ..core.dockerfile.parse import Instruction
from ..errors import DsecError, InvalidRequest, LimitExceeded, NotFound
from ..images.store import normalize
from ..protocol.names import check_name
from ..protocol.sandbox import BuildStepResult, DockerfileBuildRequest
from ..tenancy import Caller
from .service import DEFAULT_TEMPLATE, E2BService
from .template_models import BuildStart, LogEntry
from .template_plan import BASE_STEP, Plan, plan
from .template_store import Build, Template, TemplateStore, now

log = logging.getLogger("dsec.e2b.templates")

E2B_BASE_IMAGE = "e2bdev/base"  # what the SDK's from_base_image() names: E2B's template `base` is built on it
MAX_CONTEXT = 256 << 20  # all of a build's uploads together (the builder holds its context in memory)
MAX_LOG_ENTRIES = 20_000
MAX_LINE = 4096
KEPT_LOGS = 256  # builds whose logs are kept (the newest)
CONCURRENT_BUILDS = 2  # at once on the node; more wait ("building", their log says so)
MAX_PENDING = 8  # builds of one owner started and not finished
MAX_UPLOADS = 4 << 30  # bytes of uploads kept per owner: past it the least recently used go (the SDK uploads again)
UPLOAD_TTL = 3600  # seconds an upload link works


@dataclass
class BuildLog:
    entries: list[LogEntry] = field(default_factory=list)
    partial: dict[str, bytes] = field(default_factory=dict)
    step: str = BASE_STEP

    def add(self, message: str, level: str = "info", step: str | None = None) -> None:
        if len(self.entries) >= MAX_LOG_ENTRIES:
            return
        if len(self.entries) == MAX_LOG_ENTRIES - 1:
            message, level = f"the build's log is cut here ({MAX_LOG_ENTRIES} entries)", "warn"
        self.entries.append(LogEntry(timestamp=now(), message=message[:MAX_LINE], level=level, step=step))

    def output(self, stream: str, data: bytes) -> None:
        """A RUN's output as it is written: one entry per line."""
        text = self.partial.pop(stream, b"") + data
        *lines, rest = text.split(b"\n")
        if len(rest) > MAX_LINE:
            lines, rest = [*lines, rest], b""
        if rest:
            self.partial[stream] = rest
        for line in lines:
            self.add(line.decode(errors="replace").rstrip("\r"), step=self.step)

    def flush(self) -> None:
        for rest in self.partial.values():
            self.add(rest.decode(errors="replace"), step=self.step)
        self.partial.clear()


def owner_dir(root: Path, owner: str | None) -> Path:
    return root / blake3.blake3((owner or "").encode()).hexdigest()[:32]


def merged_context(uploads: dict[str, bytes]) -> bytes:
    """One context for the Dockerfile build: each upload (a tar, maybe gzipped) under its hash, so that
    two COPY steps never see each other's files (one may hold a link the other resolved)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        for digest, data in uploads.items():
            try:
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                    for info in tar:
                        name = posixpath.normpath("/" + info.name).lstrip("/")
                        if not name:
                            continue
                        if not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
                            raise InvalidRequest(
                                f"upload {digest[:12]}: {info.name[:200]!r} is a device or special file"
                            )
                        body = tar.extractfile(info) if info.isreg() else None
                        info.name = f"{digest}/{name}"
                        if info.islnk():
                            info.linkname = f"{digest}/" + posixpath.normpath("/" + info.linkname).lstrip("/")
                        out.addfile(info, body)
            except (tarfile.TarError, EOFError, OSError) as e:
                raise InvalidRequest(f"upload {digest[:12]} is not a readable tar archive: {e}") from None
    return buf.getvalue()


class TemplateBuilds:
    def __init__(self, svc: E2BService, store: TemplateStore, root: Path, key: bytes) -> None:
        self.svc = svc
        self.mgr = svc.mgr
        self.store = store
        self.uploads = root / "uploads"
        self.key = key
        self.logs: OrderedDict[str, BuildLog] = OrderedDict()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.owners: dict[str, str | None] = {}  # build id -> its template's owner, while it runs
        self.slots = asyncio.Semaphore(CONCURRENT_BUILDS)

    # ---- uploads ---------------------------------------------------------------------------------

    def upload_path(self, owner: str | None, files_hash: str) -> Path:
        return owner_dir(self.uploads, owner) / f"{files_hash}.tar"

    def has_upload(self, owner: str | None, files_hash: str) -> bool:
        return self.upload_path(owner, files_hash).exists()

    def _sign(self, template_id: str, files_hash: str, expires: int) -> str:
        message = f"e2b-upload\0{template_id}\0{files_hash}\0{expires}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def upload_link(self, base_url: str, template_id: str, files_hash: str) -> str:
        """Where the SDK PUTs a step's files: a link that opens that one upload for an hour (the SDK
        sends no API key with it, as to E2B's presigned storage links)."""
        expires = int(time.time()) + UPLOAD_TTL
        sig = self._sign(template_id, files_hash, expires)
        return f"{base_url.rstrip('/')}/e2b-template-files/{template_id}/{files_hash}/{expires}/{sig}/build-contexts"

    def check_link(self, template_id: str, files_hash: str, expires: int, sig: str) -> Template:
        good = hmac.compare_digest(sig, self._sign(template_id, files_hash, expires))
        template = self.store.data.templates.get(template_id)
        if not good or expires < time.time() or template is None:
            raise NotFound("this upload link is not valid (wrong, expired, or its template is gone)")
        return template

    async def put_upload(self, owner: str | None, files_hash: str, data: bytes) -> None:
        try:
            await asyncio.to_thread(_check_tar, data)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise InvalidRequest(f"the upload is not a tar archive: {e}") from None
        path = self.upload_path(owner, files_hash)
        await asyncio.to_thread(_write, path, data)
        await asyncio.to_thread(_evict, path.parent, MAX_UPLOADS, path)

    # ---- builds ----------------------------------------------------------------------------------

    def log_of(self, build_id: str) -> BuildLog:
        found = self.logs.get(build_id)
        if found is None:
            found = self.logs[build_id] = BuildLog()
            while len(self.logs) > KEPT_LOGS:
                self.logs.popitem(last=False)
        return found

    def start(self, template: Template, build: Build, start: BuildStart, caller: Caller) -> None:
        if build.id in self.tasks or build.status != "waiting":
            raise InvalidRequest(f"build {build.id} was started already")
        if sum(1 for owner in self.owners.values() if owner == template.owner) >= MAX_PENDING:
            raise LimitExceeded(f"{MAX_PENDING} template builds of this owner are running; wait for one to end")
        if start.from_image_registry:
            raise InvalidRequest(
                "registry credentials in a template (from_image with username/password, from_aws_registry, "
                "from_gcp_registry) are not taken by dsec: builds pull with the node's registry credentials "
                "(dsec serve --registry-auth), so that no tenant's secret is kept with a build"
            )
        plan(start, "scratch", build.id)  # a step that cannot be one is the request's error, not the build's
        build.status = "building"
        self.store.save()
        task = asyncio.get_running_loop().create_task(self._run(template, build, start, caller))
        self.tasks[build.id] = task
        self.owners[build.id] = template.owner

        def done(_: asyncio.Task[None]) -> None:
            self.tasks.pop(build.id, None)
            self.owners.pop(build.id, None)

        task.add_done_callback(done)

    async def _run(self, template: Template, build: Build, start: BuildStart, caller: Caller) -> None:
        blog = self.log_of(build.id)
        blog.add(f"Building template {template.name} (build {build.id})", step=BASE_STEP)
        made: Plan | None = None
        follow: _Follow | None = None
        try:
            async with self.slots:
                base, base_user = await self._base(start, caller)
                made = plan(start, base, build.id, base_user=base_user)
                blog.add(f"FROM {base}", step=BASE_STEP)
                context = await self._context(template, made.hashes)
                req = DockerfileBuildRequest(name=template.image(build.id), dockerfile=made.dockerfile, context=context)
                follow = _Follow(blog, made)
                await DockerfileBuild(self.mgr.builds, req, caller, on_step=follow.step, on_output=blog.output).run()
            blog.flush()
            blog.add(f"Build finished: template {template.name} is ready", step=blog.step)
            self.store.finish(template, build, "ready", None, None)
            await self.remove_images(self.store.prune(template), caller)
        except asyncio.CancelledError:
            self.store.finish(template, build, "error", "the build was cancelled (the daemon stopped)", blog.step)
            raise
        except Exception as e:  # every failure is the build's status, never the daemon's
            blog.flush()
            message = e.message if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
            if follow is not None:
                message = follow.unprefixed(message)
            message = _as_envd(message, made.runs.get(blog.step) if made is not None else None)
            step = blog.step if made is not None else BASE_STEP
            what = made.descriptions.get(step, "the base image") if made is not None else "the base image"
            reason = f"step {step} ({what}) failed: {message}"
            blog.add(reason, level="error", step=step)
            if not isinstance(e, DsecError):
                log.exception("E2B template build %s failed", build.id)
            self.store.finish(template, build, "error", reason, step)

    async def in_use(self, images: list[str]) -> bool:
        """Whether a live sandbox runs on one of ``images``."""
        used = self.mgr.images_in_use()
        for image in images:
            tag = await self.mgr.images.catalog.tag(normalize(image))
            if tag is not None and tag.digest in used:
                return True
        return False

    async def remove_images(self, images: list[str], caller: Caller) -> list[str]:
        """Remove what images it can; those still used (a live sandbox, a later template's base) stay."""
        kept = []
        for image in images:
            try:
                await self.mgr.remove_image(image, caller=caller)
            except NotFound:
                pass
            except DsecError as e:
                log.info("E2B template image %s kept: %s", image, e.message)
                kept.append(image)
        return kept

    async def _base(self, start: BuildStart, caller: Caller) -> tuple[str, str | None]:
        """The dsec image a build starts from, and (for another E2B template) the user its steps start as."""
        if start.from_template:
            found = self.store.find(start.from_template)
            if found is None:
                if start.from_template != DEFAULT_TEMPLATE and start.from_template not in self.svc.options.templates:
                    raise NotFound(f"no template {start.from_template[:120]!r}")
                return self.svc.template(start.from_template, {})[0], None
            template, tag = self.store.visible(start.from_template, caller)
            image = template.image(self.store.build_of(template, tag).id)
            ref = await self.mgr.images.resolve(image, caller=caller)
            config = (await self.mgr.images.catalog.version(ref.digest)).config
            return image, config.user or "root"
        image = start.from_image or E2B_BASE_IMAGE
        if image.split(":")[0] in (E2B_BASE_IMAGE, f"docker.io/{E2B_BASE_IMAGE}"):
            return self.svc.template(DEFAULT_TEMPLATE, {})[0], None
        return check_name(image), None

    async def _context(self, template: Template, hashes: list[str]) -> str | None:
        if not hashes:
            return None
        uploads: dict[str, bytes] = {}
        total = 0
        for files_hash in dict.fromkeys(hashes):
            path = self.upload_path(template.owner, files_hash)
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except FileNotFoundError:
                raise InvalidRequest(f"the files of hash {files_hash[:12]} were not uploaded") from None
            total += len(data)
            if total > MAX_CONTEXT:
                raise InvalidRequest(f"the build's uploads exceed {MAX_CONTEXT >> 20} MiB together")
            uploads[files_hash] = data
        merged = await asyncio.to_thread(merged_context, uploads)
        return await self.mgr.builds.put_context(merged)


class _Follow:
    """Turns the Dockerfile build's instructions back into E2B's steps, for the log and the failing step."""

    def __init__(self, blog: BuildLog, made: Plan) -> None:
        self.blog = blog
        self.made = made
        self.inst: Instruction | None = None

    def unprefixed(self, message: str) -> str:
        """A failure without the generated instruction the builder names (the step's own words are shown)."""
        if self.inst is not None:
            where, text = self.inst.where(), repr(self.inst.text[:200])
            for prefix in (f"{where}: {text}: ", f"{where}: {text} ", f"{where}: "):
                if message.startswith(prefix):
                    return message[len(prefix) :]
        return message

    def step(self, inst: Instruction, done: BuildStepResult | None) -> None:
        self.inst = inst
        step = self.made.steps.get(inst.line, self.blog.step)
        if done is None and step != self.blog.step:
            self.blog.flush()
            self.blog.step = step
            self.blog.add(f"[{step}] {self.made.descriptions.get(step, '')}".rstrip(), step=step)
        elif done is not None and done.cached:
            self.blog.add(f"[{step}] cached", level="debug", step=step)


def _as_envd(message: str, run: tuple[str, str] | None) -> str:
    """A RUN as an account the image lacks fails with envd's words, which E2B's users match on."""
    unknown = re.match(r"user '([^']*)' is not in the image's /etc/passwd", message)
    if run is None or unknown is None:
        return message
    command, user = run
    return (
        f"failed to run command {command!r}: command failed: unauthenticated: invalid username: {user!r} "
        "(it is not in the image's /etc/passwd)"
    )


def _evict(directory: Path, limit: int, keep: Path) -> None:
    files = sorted(directory.glob("*.tar"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for path in files:
        if total <= limit:
            return
        if path != keep:
            total -= path.stat().st_size
            path.unlink(missing_ok=True)


def _check_tar(data: bytes) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for _ in tar:
            pass


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
