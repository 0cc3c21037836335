"""Checkpoints: a sandbox's state kept under an id (and a name), to roll back to in place.

What a checkpoint captures is the writable layer, packed like a snapshot's (pack_diff) but kept on this
node beside the sandbox instead of published as an image, and never scrubbed: it is the sandbox's own
state, for the sandbox's own use. A rollback ends every process of the sandbox and starts it again, with
the same id, limits, network policy, volumes and exposed ports, on its image with the checkpoint's
layers on top and an empty writable layer: its files are exactly as they were at the checkpoint, its
processes are new. Layers are stacked, never merged: a checkpoint taken after a rollback adds one layer
to the stack the rollback put in place (core/checkpoint_files.py keeps them).

Checkpoint ids are numbered per sandbox (c1, c2, ...), so a trajectory's rebuild, which makes the same
calls in the same order on a new sandbox, takes the same ids, and a rollback in its log names the same
checkpoint in the rebuilt one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from pathlib import Path
from typing import cast

from ..errors import CheckpointNotFound, DsecError, InvalidRequest, LimitExceeded
from ..images.store import ImageRef
from ..kinds.base import Backend
from ..protocol.checkpoints import MAX_CHECKPOINTS, CheckpointInfo, CheckpointRequest, RollbackRequest
from ..protocol.sandbox import (
    TERMINAL_STATES,
    CreateSandbox,
    ForkRequest,
    ForkResult,
    Kind,
    SandboxInfo,
    State,
)
from ..store.records import CheckpointRecord, SandboxRecord
from ..tenancy import OPERATOR, Caller
from . import forks
from .checkpoint_files import BASE, MEMORY, CheckpointFiles
from .lifecycle import Lifecycle

log = logging.getLogger("dsec.core")


def _info(rec: SandboxRecord, c: CheckpointRecord, processes: bool) -> CheckpointInfo:
    return CheckpointInfo(
        id=c.id,
        name=c.name,
        sandbox_id=rec.id,
        created_at=c.created_at,
        size=c.size,
        seconds=c.seconds,
        processes=processes,
    )


class Checkpoints:
    def __init__(self, lifecycle: Lifecycle, root: Path) -> None:
        self.lifecycle = lifecycle
        self.sandboxes = lifecycle.sandboxes
        self.images = lifecycle.images
        self.files = CheckpointFiles(root)
        self.sandboxes.on_end.append(self._ended)

    def _ended(self, sid: str) -> None:
        # the layers a running copy was made from stay open in its mounts: only the names go
        if sid in self.files.holding:
            self.sandboxes.in_background(asyncio.to_thread(self.files.remove_all, sid))

    async def start(self) -> int:
        """After a restart: drop the checkpoints of sandboxes that ended while the daemon was down."""
        live = {rec.id for rec in self.sandboxes.live()}
        return await asyncio.to_thread(self.files.sweep, live)

    def _supported(self, rec: SandboxRecord, what: str) -> None:
        backend = self.sandboxes.backends[rec.kind]
        if not (backend.restackable or backend.forks_memory):
            raise InvalidRequest(
                f"sandboxes of kind {rec.kind!r} cannot {what} yet; snapshot() it and create new sandboxes from "
                "that image instead"
            )

    def _files_only(self, rec: SandboxRecord, what: str) -> None:
        support = self.sandboxes.backends[rec.kind].checkpoint_support()
        if not support.processes:
            raise InvalidRequest(
                f"sandboxes of kind {rec.kind!r} are {what} with their files only on this node, not their "
                f"processes ({support.why}); ask processes=false"
            )

    async def _pack(self, rec: SandboxRecord, backend: Backend) -> tuple[Path, float]:
        """The sandbox's writable layer, packed (it is held still meanwhile); and how long that took."""
        scratch = await asyncio.to_thread(self.files.scratch, rec.id)
        began = time.monotonic()
        async with self.sandboxes.packing(rec.id), backend.frozen_upper(rec) as upper:
            staged = await self.images.pack(upper, None, into=scratch)
        return staged.blob, time.monotonic() - began

    async def _keep(self, rec: SandboxRecord, backend: Backend) -> tuple[Path, float]:
        """The whole sandbox saved with its memory (a VM: its files are in its memory); how long it took."""
        scratch = await asyncio.to_thread(self.files.scratch, rec.id)
        memory = scratch / f"memory-{secrets.token_hex(4)}"
        began = time.monotonic()
        try:
            await backend.keep_memory(rec, memory)
        except BaseException:
            memory.unlink(missing_ok=True)
            raise
        return memory, time.monotonic() - began

    async def take(self, sandbox_id: str, req: CheckpointRequest, *, caller: Caller = OPERATOR) -> CheckpointInfo:
        """A new checkpoint: the sandbox's writable layer packed, or a VM's memory saved. Allowed in: running."""
        rec, _ = self.sandboxes.running(sandbox_id, caller)
        self._supported(rec, "take checkpoints")
        if req.processes:
            self._files_only(rec, "checkpointed")
        async with self.sandboxes.lock(rec.id):
            rec, backend = self.sandboxes.running(sandbox_id)
            if len(rec.checkpoints) >= MAX_CHECKPOINTS:
                raise LimitExceeded(
                    f"sandbox {rec.id} holds {len(rec.checkpoints)} checkpoints, the most it may: remove one first"
                )
            if req.name is not None and any(c.name == req.name or c.id == req.name for c in rec.checkpoints):
                raise InvalidRequest(f"sandbox {rec.id} already has a checkpoint named {req.name!r}")
            if backend.forks_memory:
                blob, held = await self._keep(rec, backend)
            else:
                blob, held = await self._pack(rec, backend)
            try:
                size = blob.stat().st_blocks * 512  # what it holds on disk: a saved memory has holes
                used = await asyncio.to_thread(self.files.size, rec.id)
                if used + size > rec.limits.disk:
                    raise LimitExceeded(
                        f"checkpoints of sandbox {rec.id} would hold {used + size} bytes on disk, over its disk "
                        f"limit of {rec.limits.disk}: remove one first"
                    )
                cid = f"c{rec.checkpoints_taken + 1}"
                if backend.forks_memory:
                    await asyncio.to_thread(self.files.save, rec.id, cid, [], blob, MEMORY)
                else:
                    below = await asyncio.to_thread(self.files.stack, rec.id)
                    await asyncio.to_thread(self.files.save, rec.id, cid, below, blob)
            finally:
                blob.unlink(missing_ok=True)
            record = CheckpointRecord(cid, req.name, time.time(), size, round(held, 6))
            rec.checkpoints.append(record)
            rec.checkpoints_taken += 1
            self.sandboxes.store.put(rec)
            if backend.reroots:
                await self._prepare_rollback(rec, backend, cid)
        log.info("sandbox %s checkpoint %s: %d bytes, held %.1f ms", rec.id, cid, size, held * 1000)
        return _info(rec, record, backend.forks_memory)

    async def _prepare_rollback(self, rec: SandboxRecord, backend: Backend, cid: str) -> None:
        """A checkpoint is taken to come back to: its root made ready meanwhile, where the kind can. The
        checkpoint is saved: nothing here may fail the call."""
        try:
            layers = await asyncio.to_thread(self.files.stack, rec.id, cid)
            backend.prepare_reroot(rec, await self.image_at(rec, layers))
        except (DsecError, OSError) as e:
            log.info("sandbox %s: no root prepared for checkpoint %s: %s", rec.id, cid, e)

    def listed(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> list[CheckpointInfo]:
        rec = self.sandboxes.get(sandbox_id, caller)
        backend = self.sandboxes.backends.get(rec.kind)
        return [_info(rec, c, backend is not None and backend.forks_memory) for c in rec.checkpoints]

    def _find(self, rec: SandboxRecord, ref: str) -> CheckpointRecord:
        for c in rec.checkpoints:
            if c.id == ref or c.name == ref:
                return c
        raise CheckpointNotFound(f"sandbox {rec.id} has no checkpoint {ref!r}; `checkpoints()` lists them")

    async def remove(self, sandbox_id: str, ref: str, *, caller: Caller = OPERATOR) -> None:
        rec = self.sandboxes.get(sandbox_id, caller)
        async with self.sandboxes.lock(rec.id):
            found = self._find(rec, ref)
            await asyncio.to_thread(self.files.remove, rec.id, found.id)
            rec.checkpoints.remove(found)
            if rec.state not in TERMINAL_STATES:
                self.sandboxes.store.put(rec)

    async def image_at(self, rec: SandboxRecord, layers: list[Path]) -> ImageRef:
        """The sandbox's image version with ``layers`` on top."""
        base = await self.images.resolve(rec.image, version=rec.image_digest or None)
        return dataclasses.replace(base, stack=tuple(layers))

    async def rollback(self, sandbox_id: str, req: RollbackRequest, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Put the sandbox back at the checkpoint (``_start_again``), same id. Allowed in: running."""
        rec, _ = self.sandboxes.running(sandbox_id, caller)
        self._supported(rec, "roll back")
        async with self.sandboxes.lock(rec.id):
            rec, backend = self.sandboxes.running(sandbox_id)
            found = self._find(rec, req.checkpoint)
            began = time.monotonic()
            timings = dict(rec.timings)
            with self.sandboxes.resetting(rec.id):
                try:
                    made_again = await self._start_again(rec, backend, found.id)
                except BaseException as e:
                    why = e.message if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
                    self.sandboxes.set_state(rec, State.failed, f"rollback to {found.id} failed: {why}")
                    self.sandboxes.in_background(backend.destroy(rec))
                    raise
                finally:
                    rec.timings = timings
            if made_again:  # in place, the record is as it was: no write
                self.sandboxes.store.put(rec)
        log.info("sandbox %s rolled back to %s in %.1f ms", rec.id, found.id, (time.monotonic() - began) * 1000)
        return rec.info()

    async def _start_again(self, rec: SandboxRecord, backend: Backend, cid: str) -> bool:
        """The sandbox back at checkpoint ``cid``: a VM restored from its memory; a container's processes
        ended and its root put back in place (``Backend.reroot``), keeping its init, network and cgroups;
        any other sandbox (or a container where that failed) made again on its image with the
        checkpoint's layers on top. Whether it was made again (its record changed)."""
        if backend.forks_memory:
            kept = backend.kept(rec, self.files.memory(rec.id, cid))  # its shape, read before it stops
            await backend.destroy(rec)
            await backend.restore(rec, rec, kept)
            return True
        # two small directory listings, on the loop: a hop to a thread costs more here, where the
        # whole rollback takes a few milliseconds
        layers, based = self.files.stack_and_base(rec.id, cid)
        image = await self.image_at(rec, layers)
        try:
            in_place = await backend.reroot(rec, image)
        except Exception as e:  # its processes are ended: making it again is as exact
            log.warning("sandbox %s: rollback in place failed, creating it again: %s", rec.id, e)
            in_place = False
        if in_place:  # the next rollback is most often to the same checkpoint (an episode's start)
            backend.prepare_reroot(rec, image)
        if not in_place:
            await backend.destroy(rec)
        if not based:
            await asyncio.to_thread(self.files.save, rec.id, BASE, layers, None)
        if not in_place:
            await backend.create(rec, image)
        return not in_place

    # ---- fork ------------------------------------------------------------------------------------------

    async def fork(self, sandbox_id: str, req: ForkRequest, *, caller: Caller = OPERATOR) -> ForkResult:
        """``req.n`` new sandboxes on the files of this one (now, or at ``req.checkpoint``): its image with
        the layers of that state on top, shared read-only by every copy (nothing is copied), each with a
        writable layer of its own. Each copy is made, or fails, on its own. Allowed in: running."""
        started = time.monotonic()
        parent = self.sandboxes.get(sandbox_id, caller)
        backend = self.sandboxes.backends[parent.kind]
        if not backend.restackable:  # a VM's copies come from its memory: now, or a checkpoint's
            kept = None
            if req.checkpoint is not None and backend.forks_memory:
                kept = self.files.memory(parent.id, self._find(parent, req.checkpoint).id)
            return await forks.fork(self.sandboxes, sandbox_id, req, caller, kept=kept)
        parent, _ = self.sandboxes.running(sandbox_id, caller)
        if req.processes:
            self._files_only(parent, "forked")
        temporary = None
        async with self.sandboxes.lock(parent.id):
            parent, backend = self.sandboxes.running(sandbox_id)
            if req.checkpoint is not None:
                name = self._find(parent, req.checkpoint).id
            else:  # the sandbox as it is now: a checkpoint of it that nobody lists, gone after the copies
                blob, _ = await self._pack(parent, backend)
                temporary = name = f".fork-{secrets.token_hex(4)}"
                below = await asyncio.to_thread(self.files.stack, parent.id)
                try:
                    await asyncio.to_thread(self.files.save, parent.id, name, below, blob)
                finally:
                    blob.unlink(missing_ok=True)
            layers = await asyncio.to_thread(self.files.stack, parent.id, name)
        try:
            image = await self.image_at(parent, layers)
            spec = CreateSandbox(
                image=parent.image,
                kind=cast(Kind, parent.kind),
                limits=parent.limits,
                timeout=forks.copy_ttl(parent, req),
                env=parent.env,
                labels=parent.labels if req.labels is None else req.labels,
                network=parent.network,
                on_timeout=parent.on_timeout,
            )
            copies = [self._copy(parent, spec, image, layers) for _ in range(req.n)]
            results = await asyncio.gather(*copies, return_exceptions=True)
        finally:
            if temporary is not None:
                await asyncio.to_thread(self.files.remove, parent.id, temporary)
        made = [r for r in results if isinstance(r, SandboxRecord)]
        return forks.outcome(parent, made, results, started)

    async def _copy(
        self, parent: SandboxRecord, spec: CreateSandbox, image: ImageRef, layers: list[Path]
    ) -> SandboxRecord:
        child = await self._from_pool(parent, spec, image)
        if child is None:
            child = await self.lifecycle.create_on(spec, image, owner=parent.owner)
        try:
            # its own links to the layers it stands on: the parent's checkpoints may go, it stays whole
            await asyncio.to_thread(self.files.save, child.id, BASE, layers, None)
        except BaseException:
            await self.lifecycle.kill(child.id)
            raise
        child.forked_from = parent.id
        self.sandboxes.store.put(child)
        return child

    async def _from_pool(self, parent: SandboxRecord, spec: CreateSandbox, image: ImageRef) -> SandboxRecord | None:
        """An idle warm-pool sandbox of the parent's image version, put on the copy's files in place
        (``Backend.reroot``): no creation at all. None: no idle one (or the kind cannot): make one."""
        if not self.sandboxes.backends[parent.kind].reroots:
            return None
        rec = self.lifecycle.claim(spec, dataclasses.replace(image, stack=()), Caller(parent.owner))
        if rec is None:
            return None
        try:
            async with self.sandboxes.lock(rec.id):
                done = await self.sandboxes.backends[rec.kind].reroot(rec, image)
        except Exception as e:
            log.warning("sandbox %s from a warm pool could not take a copy's files: %s", rec.id, e)
            done = False
        if not done:
            await self.lifecycle.kill(rec.id)
            return None
        return rec
