"""Image builds: each step runs in a fresh builder sandbox on the layers so far and is packed as one layer.

Builder sandboxes run as the builder account: root in the sandbox, with full network (apt, pip) but
never the host itself, the daemon, metadata or other sandboxes (network policy "full"),
seeing the build's arguments and only the secrets a step names. The image they produce is started
later as a runtime sandbox: no network, none of the build's arguments or secrets. Before a layer is
packed, residue is scrubbed; after, the packed bytes are searched for every secret value, and a
layer that holds one is refused rather than published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import blake3

from ..errors import BuildFailed, InvalidRequest
from ..images import squash
from ..images.canary import call_canaries
from ..images.model import CachedStep, ImageConfig, LayerRef
from ..images.scrub import ScrubRules
from ..images.store import ImageRef, ImageStore, StagedLayer, normalize
from ..kinds.base import Backend
from ..protocol.build import BUILDER_CA, HOST_CA_BUNDLE, BuildSpec, LayerRole, Step
from ..protocol.sandbox import BuildRequest, BuildResult, BuildStepResult, CreateSandbox, ExecRequest, LayerInfo, Limits
from ..store.records import SandboxRecord
from ..tenancy import OPERATOR, Caller
from .lifecycle import Lifecycle

log = logging.getLogger("dsec.builds")

BUILDER_LIMITS = Limits(cpu=2.0, memory=4 << 30, disk=16 << 30, pids=8192)
# the platform resolver's address and the CA bundle the builder borrowed from the host, never part of an image
BUILD_SCRUB = ("etc/resolv.conf", "etc/dsec-build")
# tools that take a CA bundle from the environment find the host's (see spec.BUILDER_CA)
CA_ENV = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
GIT_SCRUB = r"""
for g in $(find / -xdev -type d -name .git -prune 2>/dev/null); do
  d=${g%/.git}
  head=$(git -C "$d" symbolic-ref -q HEAD || true)
  git -C "$d" for-each-ref --format='%(refname)' | while read -r ref; do
    [ "$ref" = "$head" ] || git -C "$d" update-ref -d "$ref"
  done
  git -C "$d" stash clear 2>/dev/null || true
  git -C "$d" reflog expire --expire=now --all
  git -C "$d" gc --prune=now --quiet
done
"""


def _secret_in(blob: Path, values: list[bytes]) -> bool:
    """Whether any secret's bytes appear in the packed layer (chunks overlap so none is split unseen)."""
    values = [v for v in values if len(v) >= 4]
    if not values:
        return False
    overlap = max(len(v) for v in values) - 1
    tail = b""
    with open(blob, "rb") as f:
        while block := f.read(8 << 20):
            window = tail + block
            if any(v in window for v in values):
                return True
            tail = window[-overlap:] if overlap else b""
    return False


def cache_root(caller: Caller, digest: str) -> str:
    """The first key of a build cache's chain: the base image's digest, salted per tenant."""
    return digest if caller.operator else blake3.blake3(f"{caller.tenant}\0{digest}".encode()).hexdigest()


def _check_secrets(req: BuildRequest) -> None:
    for step in req.spec.steps:
        unknown = set(step.secrets) - set(req.secrets)
        if unknown:
            raise InvalidRequest(f"step {step.describe()!r} names secrets that were not given: {sorted(unknown)}")


def _base_config(spec: BuildSpec, base: ImageConfig) -> ImageConfig:
    """The base image's config with the spec's settings on top (the steps may change env and workdir)."""
    config = base.model_copy(deep=True)
    config.env.update(spec.env)
    if spec.workdir:
        config.workdir = spec.workdir
    if spec.entrypoint is not None:
        config.entrypoint = spec.entrypoint
    if spec.user is not None:
        config.user = spec.user
    return config


def _step_done(
    name: str, spec: BuildSpec, index: int, ref: LayerRef, scrubbed: list[str], cached: bool, seconds: float
) -> BuildStepResult:
    step = spec.steps[index]
    log.info(
        "build %s: step %d/%d %s (%s, %.1fs)",
        name,
        index + 1,
        len(spec.steps),
        step.describe(),
        "cached" if cached else "built",
        seconds,
    )
    return BuildStepResult(
        index=index,
        description=step.describe(),
        cached=cached,
        seconds=round(seconds, 3),
        layer=LayerInfo(**ref.model_dump(mode="json")),
        scrubbed=scrubbed,
    )


class Builder:
    def __init__(self, lifecycle: Lifecycle, images: ImageStore) -> None:
        self.lifecycle = lifecycle
        self.images = images
        self.contexts = images.root / "contexts"
        self.contexts.mkdir(parents=True, exist_ok=True)
        self.host_ca = os.path.exists(HOST_CA_BUNDLE)

    # ---- build contexts (what copy steps copy) -----------------------------------------------------

    async def put_context(self, data: bytes) -> str:
        digest = blake3.blake3(data).hexdigest()
        path = self.contexts / f"{digest}.tar"
        if not await asyncio.to_thread(path.exists):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            await asyncio.to_thread(tmp.write_bytes, data)
            await asyncio.to_thread(os.rename, tmp, path)
        return digest

    async def _context(self, step: Step) -> bytes:
        assert step.copy_ is not None
        if step.copy_.context is None:
            raise InvalidRequest(f"copy step {step.copy_.src!r} has no uploaded context (the SDK uploads it)")
        return await self.context_bytes(step.copy_.context)

    async def context_bytes(self, digest: str) -> bytes:
        """An uploaded build context (a tar), by the digest its upload was answered with."""
        path = self.contexts / f"{digest}.tar"
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise InvalidRequest(f"build context {digest} is not on this node; upload it again") from None

    # ---- the build ---------------------------------------------------------------------------------

    async def build(self, req: BuildRequest, *, caller: Caller = OPERATOR) -> BuildResult:
        with call_canaries(req.canaries):  # each step's layer, and every layer of the image, searched for them
            return await self._build(req, caller)

    async def _build(self, req: BuildRequest, caller: Caller) -> BuildResult:
        spec = req.spec
        started = time.monotonic()
        name = await self.images.check_free(spec.name, caller)
        _check_secrets(req)
        rules = self.images.scrub.plus([*spec.scrub, *BUILD_SCRUB], defaults=spec.scrub_defaults)
        base = await self.images.resolve(normalize(spec.base), caller=caller)
        base_version = await self.images.catalog.version(base.digest)
        layers: list[LayerRef] = list(base_version.layers)
        config = _base_config(spec, base_version.config)
        # a tenant's build cache is its own: a hit would tell it what another tenant built, and hand it
        # a layer built with that tenant's secrets (secrets are not part of cache keys)
        key = cache_root(caller, base.digest)
        results: list[BuildStepResult] = []
        scrubbed: list[str] = []
        async with self.images.catalog.publishing():
            for index, step in enumerate(spec.steps):
                t0 = time.monotonic()
                if not step.makes_layer:
                    config.env.update(step.env or {})
                    config.workdir = step.workdir or config.workdir
                    key = spec.step_key(key, step, req.args)
                    results.append(BuildStepResult(index=index, description=step.describe(), cached=True, seconds=0))
                    continue
                key = spec.step_key(key, step, req.args)
                ref, step_scrubbed, cached = await self._layer(key, index, step, layers, config, req, rules)
                layers.append(ref)
                scrubbed += step_scrubbed
                results.append(_step_done(name, spec, index, ref, step_scrubbed, cached, time.monotonic() - t0))
            own = layers[len(base_version.layers) :]
            if len(own) > 1:
                merged = await self.squash_residue(name, own, rules)
                if merged is not None:
                    layers = [*base_version.layers, merged]
            info = await self.images.publish_version(
                name,
                layers,
                config=config,
                parent=base.digest,
                description=spec.description or f"built from {base.name}",
                scrubbed=list(dict.fromkeys(scrubbed)),
                owner=caller.owner,
            )
        return BuildResult(image=info, steps=results, seconds=round(time.monotonic() - started, 3))

    async def _layer(
        self,
        key: str,
        index: int,
        step: Step,
        layers: list[LayerRef],
        config: ImageConfig,
        req: BuildRequest,
        rules: ScrubRules,
    ) -> tuple[LayerRef, list[str], bool]:
        """The step's layer, what was scrubbed from it, and whether it came from the build cache."""
        cached_step = await self.images.catalog.cached_step(key)
        if cached_step is not None:
            return cached_step.layer, cached_step.scrubbed, True
        staged = await self._run_step(req.spec, step, layers, config, req, rules)
        what = f"step {index + 1} ({step.describe()})"
        ref = await self.keep(key, staged, step.layer_role, step.describe(), what, req.secrets)
        return ref, staged.scan.scrubbed, False

    async def keep(
        self,
        key: str,
        staged: StagedLayer,
        role: LayerRole,
        created_by: str,
        what: str,
        secret_values: Mapping[str, str],
    ) -> LayerRef:
        """Publish a step's packed layer and cache it under ``key``, unless it holds a secret's value."""
        if await asyncio.to_thread(_secret_in, staged.blob, [v.encode() for v in secret_values.values()]):
            staged.blob.unlink(missing_ok=True)
            raise BuildFailed(
                f"{what} wrote a secret's value into the image; "
                "refusing to publish it (use the secret without storing it, or scrub where it lands)"
            )
        ref = await self.images.publish_layer(staged, role, created_by)
        await self.images.catalog.cache_step(key, CachedStep(layer=ref, scrubbed=staged.scan.scrubbed))
        return ref

    @contextlib.asynccontextmanager
    async def sandbox(
        self, base: str, layers: list[LayerRef], config: ImageConfig, env: dict[str, str], label: str
    ) -> AsyncIterator[tuple[Backend, SandboxRecord]]:
        """A builder sandbox on ``layers`` (root, full network, the host's CAs), killed on the way out."""
        digests = tuple(layer.digest for layer in layers)
        mounted = tuple(await asyncio.gather(*(self.images.layers.mount(d) for d in digests)))
        ref = ImageRef(name=base, layers=mounted, env=dict(config.env), workdir=config.workdir, layer_digests=digests)
        if self.host_ca:
            env = {**dict.fromkeys(CA_ENV, BUILDER_CA), **env}
        create = CreateSandbox(
            image=ref.name,
            limits=BUILDER_LIMITS,
            timeout=24 * 3600,
            env=env,
            labels={"dsec.build": label},
            network="full",
        )
        rec = await self.lifecycle.create_on(create, ref)
        try:
            yield self.lifecycle.sandboxes.backends[rec.kind], rec
        finally:
            with contextlib.suppress(Exception):
                await self.lifecycle.kill(rec.id)

    async def pack(self, backend: Backend, rec: SandboxRecord, rules: ScrubRules) -> StagedLayer:
        """What a builder sandbox changed, scrubbed and packed as one layer."""
        async with backend.frozen_upper(rec) as upper:
            return await self.images.pack(upper, rules)

    async def squash_residue(self, name: str, own: list[LayerRef], rules: ScrubRules) -> LayerRef | None:
        """One layer for the build's steps if a later step deleted or hid what an earlier one wrote (see
        images/squash.py); None if nothing is shadowed. The step layers stay in this caller's build cache
        only: no published version refers to them."""
        dirs = list(await asyncio.gather(*(self.images.layers.mount(layer.digest) for layer in own)))
        hidden = await asyncio.to_thread(squash.shadowed, dirs)
        if not hidden:
            return None
        tree = self.images.layers.tmp / f"squash-{secrets.token_hex(8)}"
        try:
            await asyncio.to_thread(tree.mkdir)
            await asyncio.to_thread(squash.squash, dirs, tree)
            staged = await self.images.pack(tree, rules)
        finally:
            await asyncio.to_thread(shutil.rmtree, tree, True)
        why = f"{len(own)} build steps squashed: later steps deleted {len(hidden)} paths earlier ones wrote"
        log.info("build %s: %s (e.g. %s)", name, why, ", ".join(hidden[:3]))
        return await self.images.publish_layer(staged, own[-1].role, why)

    async def _run_step(
        self,
        spec: BuildSpec,
        step: Step,
        layers: list[LayerRef],
        config: ImageConfig,
        req: BuildRequest,
        rules: ScrubRules,
    ) -> StagedLayer:
        env = {**req.args, **{k: req.secrets[k] for k in step.secrets}}
        async with self.sandbox(normalize(spec.base), layers, config, env, normalize(spec.name)) as (backend, rec):
            if step.copy_ is not None:
                await backend.upload_tar(rec, step.copy_.dest, await self._context(step))
            else:
                command = step.command()
                assert command is not None
                result = await backend.exec(
                    rec,
                    ExecRequest(
                        cmd=["/bin/sh", "-c", command], timeout=step.timeout, env=env, cwd=config.workdir or "/"
                    ),
                )
                if result.exit_code != 0 or result.timed_out:
                    why = "timed out" if result.timed_out else f"exited with status {result.exit_code}"
                    tail = (result.stdout[-1500:] + result.stderr[-1500:]).strip()
                    raise BuildFailed(f"build step {step.describe()!r} {why}: {tail}")
            if spec.scrub_git:
                await backend.exec(rec, ExecRequest(cmd=["/bin/sh", "-c", GIT_SCRUB], timeout=600))
            return await self.pack(backend, rec, rules)
