"""Fork: copies of a VM sandbox restored from one memory snapshot of it (containers: core/checkpoints.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import BackendError, DsecError, InvalidRequest
from ..kinds.base import Backend
from ..protocol.sandbox import MAX_TTL_S, ErrorBody, ForkFailure, ForkRequest, ForkResult, State
from ..store.records import SandboxRecord, new_record
from ..tenancy import Caller
from .admission import Claim
from .sandboxes import Sandboxes

log = logging.getLogger("dsec.core")


def copy_ttl(parent: SandboxRecord, req: ForkRequest) -> float:
    """A copy's time to live: as asked, else the parent's within the bound (a parent's own may have been
    extended past it, E2B's set_timeout counting from now)."""
    return req.timeout if req.timeout is not None else min(parent.expires_at - parent.created_at, MAX_TTL_S)


async def fork(
    sandboxes: Sandboxes, sandbox_id: str, req: ForkRequest, caller: Caller, *, kept: Path | None = None
) -> ForkResult:
    """``req.n`` new sandboxes restored from one memory snapshot of this one, each with its own copy
    of its memory and writable layer. Each copy is made, or fails, on its own (``ForkResult.failed``);
    only when none could be made is the call an error.

    Allowed in: running, paused (the parent is left as it was).
    """
    started = time.monotonic()
    parent = sandboxes.get(sandbox_id, caller)
    backend = sandboxes.backends[parent.kind]
    if req.checkpoint is not None and kept is None:
        raise InvalidRequest(f"sandboxes of kind {parent.kind!r} cannot be forked from a checkpoint")
    if req.processes is False:
        raise InvalidRequest(
            f"sandboxes of kind {parent.kind!r} are forked with their processes and memory; "
            "processes=false is for containers"
        )
    children: list[SandboxRecord] = []
    # the copies are sandboxes like any: admitted against the node's capacity before anything is made
    claims: list[Claim] = []
    try:
        for _ in range(req.n):
            claim = Claim(parent.owner, parent.limits.cpu, parent.limits.mem_request())
            await sandboxes.admission.admit(claim, None)
            claims.append(claim)
    except BaseException:
        for claim in claims:
            sandboxes.admission.cancel(claim)
        raise
    try:
        async with sandboxes.lock(parent.id):
            parent = sandboxes.get(sandbox_id)
            if parent.state != State.paused:
                sandboxes.running(sandbox_id)  # raises the precise error for any other state
            source = backend.checkpoint(parent) if kept is None else contextlib.nullcontext(backend.kept(parent, kept))
            async with source as checkpoint:
                ttl = copy_ttl(parent, req)
                labels = parent.labels if req.labels is None else req.labels
                for _ in range(req.n):
                    child = new_record(
                        parent.kind, parent.image, parent.image_digest, ttl, parent.limits, parent.env, labels
                    )
                    child.forked_from = parent.id
                    child.owner = parent.owner  # the parent's tenant's, even when the operator forks
                    sandboxes.admission.bind(child.id, claims.pop())
                    sandboxes.set_state(child, State.creating)
                    children.append(child)
                results = await asyncio.gather(
                    *(backend.restore(c, parent, checkpoint) for c in children), return_exceptions=True
                )
    except BaseException as e:
        for claim in claims:  # not yet given to a copy
            sandboxes.admission.cancel(claim)
        await _fail(sandboxes, backend, children, e)
        raise
    for child, r in zip(children, results, strict=True):
        if isinstance(r, BaseException):  # this copy alone: the others stand
            await _fail(sandboxes, backend, [child], r)
        else:
            sandboxes.set_state(child, State.running)
    made = [c for c, r in zip(children, results, strict=True) if not isinstance(r, BaseException)]
    return outcome(parent, made, results, started)


def outcome(parent: SandboxRecord, made: list[SandboxRecord], results: Sequence[object], started: float) -> ForkResult:
    """A fork's answer: the copies made, and each failed one's error by its place; an error itself only
    when none was made (or the call was cancelled)."""
    failed = []
    for i, r in enumerate(results):
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
        if isinstance(r, Exception):
            e = r if isinstance(r, DsecError) else BackendError(f"{type(r).__name__}: {r}")
            failed.append(ForkFailure(index=i, error=ErrorBody(code=e.code, message=e.message, detail=e.detail)))
    if not made:
        first = results[0]
        raise first if isinstance(first, DsecError) else BackendError(f"every copy failed: {failed[0].error.message}")
    seconds = time.monotonic() - started
    log.info("sandbox %s forked into %d of %d in %.2fs", parent.id, len(made), len(results), seconds)
    return ForkResult(sandboxes=[c.info() for c in made], seconds=round(seconds, 3), failed=failed)


async def _fail(sandboxes: Sandboxes, backend: Backend, children: list[SandboxRecord], e: BaseException) -> None:
    reason = str(e) if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
    for child in children:
        sandboxes.set_state(child, State.failed, f"fork failed: {reason}")
        with contextlib.suppress(Exception):
            await backend.destroy(child)
