"""Images from the SDK: list, inspect, build, import, remove (a mixin of AsyncClient, so the blocking
``Client`` has it too)."""

from __future__ import annotations

import asyncio
import builtins
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidRequest, error_from_wire
from ..protocol import dockerignore
from ..protocol.build import BuildSpec, ImageSpec, load_spec
from ..protocol.pull import PullEvent, PullPolicy, PullProgress, PushResult
from ..protocol.sandbox import BuildResult, GcResult, ImageInfo, ImageList, ImageStats
from .creating import CREATE_TIMEOUT
from .transport import Transport

BUILD_TIMEOUT = 6 * 3600.0
PULL_TIMEOUT = 6 * 3600.0  # a pull of many large layers; each line of its answer shows it is alive


def _tar_of(src: Path) -> bytes:
    """A copy step's source as a tar: a directory's contents, or one file."""
    if not src.exists():
        raise InvalidRequest(f"copy source {src} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if src.is_dir():
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
        else:
            tar.add(src, arcname=src.name)
    return buf.getvalue()


def context_tar(context: Path) -> bytes:
    """A Dockerfile's build context as a tar: the directory's files but those its ``.dockerignore``
    leaves out (the daemon applies the same file again)."""
    if not context.is_dir():
        raise InvalidRequest(f"build context {context} is not a directory")
    ignore = context / ".dockerignore"
    ruleset = dockerignore.rules(ignore.read_text(errors="replace")) if ignore.is_file() else []
    prune = not any(rule.keep for rule in ruleset)  # an ignored directory can hold nothing taken back in
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(context):
            base = Path(root).relative_to(context)
            kept_dirs = []
            for d in sorted(dirs):
                rel = (base / d).as_posix()
                if dockerignore.ignored(rel, ruleset) and prune:
                    continue
                kept_dirs.append(d)
                tar.add(Path(root) / d, arcname=rel, recursive=False)
            dirs[:] = kept_dirs
            for f in sorted(files):
                rel = (base / f).as_posix()
                if rel != ".dockerignore" and dockerignore.ignored(rel, ruleset):
                    continue
                tar.add(Path(root) / f, arcname=rel, recursive=False)
    return buf.getvalue()


class ImageClient:
    _transport: Transport

    async def images(self) -> builtins.list[ImageInfo]:
        reply = await self._transport.request("GET", "/v1/images")
        return ImageList.model_validate_json(reply.content).images

    async def build_image(self, name: str) -> ImageInfo:
        reply = await self._transport.request("POST", "/v1/images/build", params={"name": name}, timeout=CREATE_TIMEOUT)
        return ImageInfo.model_validate_json(reply.content)

    async def image(self, name: str) -> ImageInfo:
        reply = await self._transport.request("GET", "/v1/image", params={"name": name})
        return ImageInfo.model_validate_json(reply.content)

    async def image_history(self, name: str) -> builtins.list[ImageInfo]:
        """The version ``name`` points at, then its ancestors (lineage), newest first."""
        reply = await self._transport.request("GET", "/v1/image/history", params={"name": name})
        return ImageList.model_validate_json(reply.content).images

    async def image_stats(self, name: str) -> ImageStats:
        """Bytes this node fetched of the image versus its size, chunk hit rate, time waited on fetches."""
        reply = await self._transport.request("GET", "/v1/image/stats", params={"name": name})
        return ImageStats.model_validate_json(reply.content)

    async def remove_image(self, name: str) -> None:
        """Free the name (refused while a live sandbox runs on it); ``gc_images`` reclaims the space."""
        await self._transport.request("DELETE", "/v1/image", params={"name": name})

    async def gc_images(self) -> GcResult:
        reply = await self._transport.request("POST", "/v1/images/gc", timeout=CREATE_TIMEOUT)
        return GcResult.model_validate_json(reply.content)

    async def build(
        self,
        spec: BuildSpec | ImageSpec | str | Path,
        name: str | None = None,
        *,
        args: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        canaries: builtins.list[str] | None = None,
    ) -> BuildResult:
        """Build an image from a spec file (TOML), a ``BuildSpec`` or an ``ImageSpec`` builder.

        Copy steps' sources are read here and uploaded; steps run on the daemon's node in builder
        sandboxes. ``secrets`` reach only the steps that name them and are never packed into a layer.
        ``canaries``: strings (8+ bytes) no layer of the image may hold; the build is refused if one does.
        """
        resolved: BuildSpec
        if isinstance(spec, ImageSpec):
            if name is None:
                raise InvalidRequest("building an ImageSpec needs the name of the image to publish")
            resolved = spec.spec(name)  # noqa: ASYNC240 - an ImageSpec (ruff sees the Path in the union)
        elif isinstance(spec, BuildSpec):
            resolved = spec
        else:
            resolved = await asyncio.to_thread(load_spec, Path(spec))
        if name is not None:
            resolved = resolved.model_copy(update={"name": name})
        resolved = resolved.model_copy(deep=True)
        for step in resolved.steps:
            if step.copy_ is not None and step.copy_.context is None:
                data = await asyncio.to_thread(_tar_of, Path(step.copy_.src))
                reply = await self._transport.request("PUT", "/v1/build-contexts", content=data)
                step.copy_.context = str(reply.json()["context"])
        body = {
            "spec": resolved.model_dump(mode="json", by_alias=True),
            "args": args or {},
            "secrets": secrets or {},
            "canaries": canaries or [],
        }
        reply = await self._transport.request("POST", "/v1/images/builds", json=body, timeout=BUILD_TIMEOUT)
        return BuildResult.model_validate_json(reply.content)

    async def build_dockerfile(
        self,
        name: str,
        context: str | Path = ".",
        *,
        dockerfile: str | Path | None = None,
        build_args: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        target: str | None = None,
        canaries: builtins.list[str] | None = None,
    ) -> BuildResult:
        """Build ``name`` from a Dockerfile, as ``docker build -f DOCKERFILE -t NAME CONTEXT`` does.

        ``dockerfile`` defaults to CONTEXT/Dockerfile; the context (less what its ``.dockerignore`` leaves
        out) is uploaded. ``secrets`` by id serve ``RUN --mount=type=secret,id=...`` and are never packed;
        ``target`` builds that stage. Each RUN, COPY and ADD becomes a cached layer.
        """
        where = Path(context)
        path = Path(dockerfile) if dockerfile is not None else where / "Dockerfile"
        try:
            text = await asyncio.to_thread(path.read_text)
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"cannot read the Dockerfile {path}: {e}") from None
        data = await asyncio.to_thread(context_tar, where)
        reply = await self._transport.request("PUT", "/v1/build-contexts", content=data)
        body = {
            "name": name,
            "dockerfile": text,
            "context": str(reply.json()["context"]),
            "args": build_args or {},
            "secrets": secrets or {},
            "target": target,
            "canaries": canaries or [],
        }
        reply = await self._transport.request("POST", "/v1/images/dockerfile-builds", json=body, timeout=BUILD_TIMEOUT)
        return BuildResult.model_validate_json(reply.content)

    async def push(self, name: str, reference: str) -> PushResult:
        """Push the dsec image ``name`` (a build, a snapshot, a pulled image) to ``reference``
        (``registry.example:5000/org/env:1``) as a standard OCI image that ``docker pull`` runs."""
        body = {"name": name, "reference": reference}
        reply = await self._transport.request("POST", "/v1/images/push", json=body, timeout=PULL_TIMEOUT)
        return PushResult.model_validate_json(reply.content)

    async def import_image(
        self, path: str | Path, name: str, reference: str | None = None, *, canaries: builtins.list[str] | None = None
    ) -> ImageInfo:
        """Import an OCI layout directory or `docker save` tarball that is on the daemon's node
        (refused if a layer holds one of ``canaries``)."""
        body = {"path": str(path), "name": name, "reference": reference, "canaries": canaries or []}
        reply = await self._transport.request("POST", "/v1/images/import", json=body, timeout=CREATE_TIMEOUT)
        return ImageInfo.model_validate_json(reply.content)

    async def pull(
        self,
        reference: str,
        *,
        policy: PullPolicy = "if-not-present",
        on_progress: Callable[[PullProgress], None] | None = None,
    ) -> ImageInfo:
        """Pull a registry image onto the node (``registry.example:5000/org/task:1``, ``python:3.11``), its
        layers converted once and shared with every image that has them; ``on_progress`` sees each step."""
        body = {"reference": reference, "policy": policy}
        async with self._transport.stream("POST", "/v1/images/pull", json=body, timeout=PULL_TIMEOUT) as reply:
            async for line in reply.aiter_lines():
                if not line:
                    continue
                event = PullEvent.model_validate_json(line)
                if event.type == "error" and event.error is not None:
                    raise error_from_wire(event.error.code, event.error.message, event.error.detail)
                if event.type == "progress" and event.progress is not None and on_progress is not None:
                    on_progress(event.progress)
                if event.type == "result" and event.image is not None:
                    return event.image
        raise InvalidRequest(f"the pull of {reference} ended without its image (the connection was cut?)")
