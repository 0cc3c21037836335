"""Fork: copies of a VM sandbox restored from one memory snapshot of it (containers: core/checkpoints.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from ..errors import BackendError, DsecError, InvalidRequest
from ..protocol.sandbox import MAX_TTL_S, ForkRequest, ForkResult, State
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
    of its memory and writable layer. All or nothing: if one copy fails, none is kept.

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
        failed = [(c, r) for c, r in zip(children, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            first = failed[0][1]
            why = first.message if isinstance(first, DsecError) else f"{type(first).__name__}: {first}"
            raise BackendError(f"{len(failed)} of {req.n} copies of {parent.id} failed to start: {why}")
    except BaseException as e:
        for claim in claims:  # not yet given to a copy
            sandboxes.admission.cancel(claim)
        reason = str(e) if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
        for child in children:
            sandboxes.set_state(child, State.failed, f"fork failed: {reason}")
            with contextlib.suppress(Exception):
                await backend.destroy(child)
        raise
    for child in children:
        sandboxes.set_state(child, State.running)
    log.info("sandbox %s forked into %d in %.2fs", parent.id, req.n, time.monotonic() - started)
    return ForkResult(sandboxes=[c.info() for c in children], seconds=round(time.monotonic() - started, 3))
