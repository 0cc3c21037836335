"""A Dockerfile build: the stages the target needs, in order, each instruction that changes files one
cached layer made in a builder sandbox (as a TOML build's steps are: builds.py), then one published
version with the settings the target stage ended with.

A layer's cache key is what it was built on and what went into it: the command with its environment,
account and directory, or what COPY placed (names, modes, bytes; not times). Secrets are never part of
a key; a tenant's keys start from its own salt, as TOML builds' do.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import posixpath
import tarfile
import time
from collections.abc import Callable
from copy import copy as duplicate
from dataclasses import dataclass

import blake3

from ...errors import BuildFailed, InvalidRequest, NotFound
from ...images.canary import call_canaries
from ...images.model import ImageConfig, LayerRef
from ...images.scrub import ScrubRules
from ...images.store import normalize
from ...kinds.base import Backend, OutputCallback
from ...protocol.build import LayerRole
from ...protocol.sandbox import BuildResult, BuildStepResult, DockerfileBuildRequest, ExecRequest, LayerInfo
from ...store.records import SandboxRecord
from ...tenancy import OPERATOR, Caller
from ..builds import BUILD_SCRUB, Builder, cache_root
from .context import Entry, Tree, place
from .parse import Dockerfile, Instruction, Stage, global_scope, parse
from .stage import Copy, Run, StageReader, is_glob
from .words import expand

RUN_TIMEOUT = 6 * 3600.0
SCRATCH = "scratch"
# told of each instruction as it starts (None) and of each step it made once done
StepCallback = Callable[[Instruction, BuildStepResult | None], None]


@dataclass
class Built:
    """A stage once built: its layers, its settings, and the key its next layer would chain from."""

    layers: list[LayerRef]
    config: ImageConfig
    key: str
    base: str  # the image it started from (a digest), for the published version's parent
    own: int  # how many of ``layers`` the stage's base had


def _key(parent: str, payload: object) -> str:
    return blake3.blake3(json.dumps([parent, payload], sort_keys=True).encode()).hexdigest()


def needed(df: Dockerfile, target: Stage) -> list[Stage]:
    """The stages the target is built from (FROM an earlier stage, COPY --from one), in file order."""
    want = {target.index}
    for stage in reversed(df.stages[: target.index + 1]):
        if stage.index not in want:
            continue
        refs = [stage.base] + [i.flags["from"] for i in stage.instructions if "from" in i.flags]
        for ref in refs:
            found = df.stage(ref, stage.index)
            if found is not None:
                want.add(found.index)
    return [s for s in df.stages if s.index in want]


class DockerfileBuild:
    def __init__(
        self,
        builder: Builder,
        req: DockerfileBuildRequest,
        caller: Caller = OPERATOR,
        *,
        on_step: StepCallback | None = None,
        on_output: OutputCallback | None = None,
    ) -> None:
        """``on_step`` and ``on_output`` (RUN's output as it is written) let a caller follow the build."""
        self.on_step = on_step
        self.on_output = on_output
        self.builder = builder
        self.images = builder.images
        self.req = req
        self.caller = caller
        self.df: Dockerfile = parse(req.dockerfile)
        self.globals = global_scope(self.df, req.args)
        self.built: dict[int, Built] = {}
        self.steps: list[BuildStepResult] = []
        self.scrubbed: list[str] = []
        self.rules: ScrubRules = self.images.scrub.plus(list(BUILD_SCRUB))
        self.context: Tree | None = None

    async def run(self) -> BuildResult:
        with call_canaries(self.req.canaries):
            return await self._run()

    async def _run(self) -> BuildResult:
        started = time.monotonic()
        target = self.df.target(self.req.target)
        name = await self.images.check_free(self.req.name, self.caller)
        if self.req.context is not None:
            data = await self.builder.context_bytes(self.req.context)
            self.context = await asyncio.to_thread(Tree.read, data, "the build context", True)
        async with self.images.catalog.publishing():
            for stage in needed(self.df, target):
                self.built[stage.index] = await self._stage(stage)
            final = self.built[target.index]
            layers = final.layers
            own = layers[final.own :]
            if len(own) > 1:
                merged = await self.builder.squash_residue(name, own, self.rules)
                if merged is not None:
                    layers = [*layers[: final.own], merged]
            info = await self.images.publish_version(
                name,
                layers,
                config=final.config,
                parent=final.base or None,
                description=f"built from a Dockerfile (stage {target.label()})",
                scrubbed=list(dict.fromkeys(self.scrubbed)),
                owner=self.caller.owner,
            )
        return BuildResult(image=info, steps=self.steps, seconds=round(time.monotonic() - started, 3))

    # ---- a stage -----------------------------------------------------------------------------------

    async def _base(self, stage: Stage) -> Built:
        ref = expand(stage.base, self.globals, self.df.escape)
        earlier = self.df.stage(ref, stage.index)
        if earlier is not None:
            b = self.built[earlier.index]
            return Built(list(b.layers), b.config.model_copy(deep=True), b.key, b.base, len(b.layers))
        if ref == SCRATCH:
            return Built([], ImageConfig(), cache_root(self.caller, SCRATCH), "", 0)
        resolved = await self.images.resolve(normalize(ref), caller=self.caller)
        version = await self.images.catalog.version(resolved.digest)
        return Built(
            list(version.layers),
            version.config.model_copy(deep=True),
            cache_root(self.caller, resolved.digest),
            resolved.digest,
            len(version.layers),
        )

    async def _stage(self, stage: Stage) -> Built:
        built = await self._base(stage)
        reader = StageReader(self.df, stage, built.config, self.globals, self.req.args)
        for inst in stage.instructions:
            t0 = time.monotonic()
            if self.on_step is not None:
                self.on_step(inst, None)
            step = reader.step(inst)
            if step is None:
                continue
            if isinstance(step, Run):
                ref, cached = await self._run_step(built, step)
            else:
                ref, cached = await self._copy_step(built, step)
            built.layers.append(ref)
            self.steps.append(
                BuildStepResult(
                    index=len(self.steps),
                    description=f"{stage.label()}: line {inst.line}: {inst.text}"[:500],
                    cached=cached,
                    seconds=round(time.monotonic() - t0, 3),
                    layer=LayerInfo(**ref.model_dump(mode="json")),
                )
            )
            if self.on_step is not None:
                self.on_step(inst, self.steps[-1])
        built.config = reader.settings.config()
        return built

    async def _cached(self, key: str) -> LayerRef | None:
        hit = await self.images.catalog.cached_step(key)
        if hit is None:
            return None
        self.scrubbed += hit.scrubbed
        return hit.layer

    async def _keep(self, key: str, backend: Backend, rec: SandboxRecord, what: str, text: str) -> LayerRef:
        staged = await self.builder.pack(backend, rec, self.rules)
        self.scrubbed += staged.scan.scrubbed
        return await self.builder.keep(key, staged, LayerRole.workspace, text, what, self.req.secrets)

    # ---- RUN ---------------------------------------------------------------------------------------

    async def _run_step(self, built: Built, run: Run) -> tuple[LayerRef, bool]:
        secret = run.secret
        payload = {"run": run.argv, "env": run.env, "user": run.user, "cwd": run.workdir}
        if secret is not None:
            payload["secret"] = [secret.id, secret.target, secret.env or ""]
        key = _key(built.key, payload)
        built.key = key
        hit = await self._cached(key)
        if hit is not None:
            return hit, True
        value = self.req.secrets.get(secret.id) if secret is not None else None
        if secret is not None and value is None and secret.required:
            raise InvalidRequest(f"{run.inst.where()}: secret {secret.id!r} is required and was not given")
        env = dict(run.env)
        if secret is not None and value is not None and secret.env:
            env[secret.env] = value
        config = built.config.model_copy(update={"env": run.env, "workdir": run.workdir})
        async with self.builder.sandbox(self.req.name, built.layers, config, env, normalize(self.req.name)) as box:
            backend, rec = box
            if run.workdir != "/":
                await backend.mkdir(rec, run.workdir)  # WORKDIR makes its directory, as Docker's does
            made = await self._put_secret(backend, rec, secret.target, value) if secret and value is not None else []
            try:
                result = await backend.exec(
                    rec,
                    ExecRequest(cmd=run.argv, env=env, cwd=run.workdir, user=run.user, timeout=RUN_TIMEOUT),
                    on_output=self.on_output,
                )
            except (InvalidRequest, NotFound) as e:  # e.g. USER names an account the image does not have
                raise BuildFailed(f"{run.inst.where()}: {run.inst.text[:200]!r}: {e}") from None
            for path in made:
                await backend.remove(rec, path, recursive=True)
            if result.exit_code != 0 or result.timed_out:
                why = "timed out" if result.timed_out else f"exited with status {result.exit_code}"
                tail = (result.stdout[-1500:] + result.stderr[-1500:]).strip()
                raise BuildFailed(f"{run.inst.where()}: {run.inst.text[:200]!r} {why}: {tail}")
            return await self._keep(key, backend, rec, run.inst.where(), run.inst.text[:200]), False

    async def _put_secret(self, backend: Backend, rec: SandboxRecord, target: str, value: str) -> list[str]:
        """Write a secret's file; what to remove after the command (the file, and the directories made
        for it), so the layer holds none of it."""
        made: list[str] = []
        parent = posixpath.dirname(target)
        while parent != "/":
            try:
                await backend.stat(rec, parent)
                break
            except NotFound:
                made.append(parent)
                parent = posixpath.dirname(parent)
        if made:
            await backend.mkdir(rec, made[0])
        await backend.write_file(rec, target, value.encode(), 0o400)
        return [made[-1]] if made else [target]

    # ---- COPY and ADD ------------------------------------------------------------------------------

    async def _copy_step(self, built: Built, copy: Copy) -> tuple[LayerRef, bool]:
        tree, what = await self._source(copy)
        placed = await asyncio.to_thread(place, copy, tree, what)
        key = _key(built.key, {"copy": placed.key, "chown": copy.chown or ""})
        built.key = key
        hit = await self._cached(key)
        if hit is not None:
            return hit, True
        label = normalize(self.req.name)
        async with self.builder.sandbox(self.req.name, built.layers, built.config, {}, label) as (backend, rec):
            await backend.upload_tar(rec, "/", placed.tar)
            if copy.chown is not None and placed.tops:
                result = await backend.exec(
                    rec, ExecRequest(cmd=["chown", "-R", copy.chown, "--", *placed.tops], user="root", timeout=600)
                )
                if result.exit_code != 0:
                    raise BuildFailed(
                        f"{copy.inst.where()}: --chown={copy.chown} failed (it runs the image's chown): "
                        f"{(result.stdout + result.stderr).strip()[-500:]}"
                    )
            return await self._keep(key, backend, rec, copy.inst.where(), copy.inst.text[:200]), False

    async def _source(self, copy: Copy) -> tuple[Tree, str]:
        """The tree a COPY takes from: the context, an earlier stage, or an image (--from)."""
        if copy.source is None:
            if self.context is None:
                raise InvalidRequest(f"{copy.inst.where()}: there is no build context to copy from")
            return self.context, "the build context"
        current = next(s for s in self.df.stages if copy.inst in s.instructions)
        stage = self.df.stage(copy.source, current.index)
        if stage is not None:
            layers, what = self.built[stage.index].layers, f"stage {stage.label()}"
        else:
            if copy.source.isdigit():
                raise InvalidRequest(f"{copy.inst.where()}: --from={copy.source}: no such earlier stage")
            ref = await self.images.resolve(normalize(copy.source), caller=self.caller)
            layers, what = list((await self.images.catalog.version(ref.digest)).layers), f"image {copy.source}"
        return await self._tree_of(layers, copy, what), what

    async def _tree_of(self, layers: list[LayerRef], copy: Copy, what: str) -> Tree:
        """The paths a COPY --from names, read out of a sandbox on those layers."""
        entries: dict[str, Entry] = {}
        label = normalize(self.req.name)
        async with self.builder.sandbox(self.req.name, layers, ImageConfig(), {}, label) as (backend, rec):
            for src in copy.sources:
                for path in await _matches(backend, rec, src, what, copy):
                    entries.update(await _read(backend, rec, path))
        return Tree(entries)


async def _matches(backend: Backend, rec: SandboxRecord, src: str, what: str, copy: Copy) -> list[str]:
    path = posixpath.normpath("/" + src)
    base = posixpath.basename(path)
    if not is_glob(base):
        return [path]
    if is_glob(posixpath.dirname(path)):
        raise InvalidRequest(f"{copy.inst.where()}: --from takes wildcards in the last part of a path only")
    found = [e.name for e in await backend.list_dir(rec, posixpath.dirname(path)) if fnmatch.fnmatchcase(e.name, base)]
    if not found:
        raise InvalidRequest(f"{copy.inst.where()}: {src[:200]!r} not found in {what}")
    return [posixpath.join(posixpath.dirname(path), n) for n in sorted(found)]


async def _read(backend: Backend, rec: SandboxRecord, path: str) -> dict[str, Entry]:
    """A file or a directory (whole) of a sandbox, as tree entries under ``path`` (relative)."""
    rel = path.lstrip("/")
    try:
        st = await backend.stat(rec, path)
    except NotFound:
        raise InvalidRequest(f"{path[:200]!r} not found") from None
    if st.type != "dir":
        data = await backend.read_file(rec, path)
        info = tarfile.TarInfo(rel)
        info.mode, info.size = (st.mode or 0o644) & 0o7777, len(data)
        return {rel: Entry(rel, info, data)}
    inner = Tree.read(await backend.download_tar(rec, path), path)
    out = {rel: Entry(rel, _dir_info(rel, st.mode or 0o755), None)} if rel else {}
    for sub, entry in inner.entries.items():
        name = posixpath.join(rel, sub) if rel else sub
        info = entry.info
        if info.islnk():  # a hard link names its target inside the archive: the same prefix goes on it
            info = duplicate(info)
            info.linkname = posixpath.join(rel, posixpath.normpath("/" + info.linkname).lstrip("/"))
        out[name] = Entry(name, info, entry.data)
    return out


def _dir_info(name: str, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode & 0o7777
    return info
