"""E2B's sandbox lifecycle beyond create and kill: timeouts, keep-alives, pause and connect (resume), and
what a sandbox does at its timeout (``lifecycle.onTimeout`` / ``autoPause``, ``autoResume``).

A pause keeps the sandbox's memory and processes (dsec's pause); E2B's filesystem-only pause
(``keep_memory=False``, ``autoPauseMemory=false``) has no dsec counterpart and is refused, never turned
into a pause that keeps memory. An E2B sandbox that is paused stays so until it is resumed or killed
(for up to dsec's longest time to live), as E2B keeps paused sandboxes; connecting resumes it, and so
does traffic to its ports when it was made with ``autoResume``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import Body, Response

from ..errors import InvalidRequest, InvalidState
from ..protocol.sandbox import MAX_TTL_S, OnTimeout, SandboxInfo, State
from ..store.records import SandboxRecord
from ..tenancy import Caller
from . import control_models as m
from .control_common import UNSUPPORTED, Svc, Who, json_answer, live_info, parse, router, sandbox_model
from .control_doc import doc
from .errors import plain_error
from .service import E2BService

META_AUTO_RESUME = "dsec.e2b.auto-resume"  # "true": traffic to its ports resumes it when paused
NO_MEMORY = (
    "a pause without memory (mode='filesystem', keep_memory=False: autoPauseMemory or memory false) "
    + UNSUPPORTED
    + ": dsec's pause keeps the sandbox's memory and processes; leave mode (keep_memory) out"
)


def on_timeout(body: m.NewSandbox) -> tuple[OnTimeout, bool]:
    """(what the timeout does, whether traffic resumes it) from a create's autoPause, autoPauseMemory,
    autoResume and lifecycle (older SDKs)."""
    pause = body.auto_pause
    action = body.lifecycle.on_timeout if body.lifecycle is not None else None
    if isinstance(action, dict):
        if (
            action.get("keep_memory") is False
            or action.get("keepMemory") is False
            or action.get("mode") == "filesystem"
        ):
            raise InvalidRequest(NO_MEMORY)
        action = action.get("action")
    if action not in (None, "kill", "pause"):
        raise InvalidRequest(f"lifecycle.onTimeout {str(action)[:40]!r}: kill or pause")
    pause = pause or action == "pause"
    if body.auto_pause_memory is False and pause:
        raise InvalidRequest(NO_MEMORY)
    resume = body.auto_resume
    if resume is None and body.lifecycle is not None:
        resume = body.lifecycle.auto_resume
    enabled = resume.get("enabled") is True if isinstance(resume, dict) else resume is True
    if enabled and not pause:
        raise InvalidRequest("autoResume needs a sandbox that pauses at its timeout (onTimeout pause)")
    return ("pause" if pause else "stop"), enabled


def lifecycle_of(info: SandboxInfo) -> m.LifecycleInfo:
    return m.LifecycleInfo(
        auto_resume=info.labels.get(META_AUTO_RESUME) == "true",
        on_timeout="pause" if info.on_timeout == "pause" else "kill",
    )


def auto_resumes(rec: SandboxRecord) -> bool:
    return rec.state == State.paused and rec.labels.get(META_AUTO_RESUME) == "true"


@router.post("/sandboxes/{sandbox_id}/timeout", **doc(204, None, m.TimeoutRequest, body_required=True))
async def set_timeout(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """A new timeout from now; 0 reaches it at once (the sandbox is killed, or paused if it pauses)."""
    req: m.TimeoutRequest = parse(m.TimeoutRequest, body)
    live_info(svc, sandbox_id, caller)
    if req.timeout == 0:
        await svc.mgr.expire(sandbox_id, caller=caller)
    else:
        svc.mgr.set_timeout(sandbox_id, float(req.timeout), caller=caller)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", **doc(204, None, m.RefreshRequest))
async def refresh(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """Keep-alive: the time to live becomes at least ``duration`` seconds from now (a body that is no
    object is no duration: the default)."""
    duration = parse(m.RefreshRequest, body if isinstance(body, dict) else None).duration
    info = live_info(svc, sandbox_id, caller)
    if info.expires_at.timestamp() - time.time() < duration:
        svc.mgr.set_timeout(sandbox_id, float(duration), caller=caller)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", **doc(204, None, m.PauseRequest))
async def pause_sandbox(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: m.PauseRequest = parse(m.PauseRequest, body)
    if req.memory is False:
        raise InvalidRequest(NO_MEMORY)
    info = live_info(svc, sandbox_id, caller)
    if info.state == State.paused:
        return plain_error(409, f"sandbox {sandbox_id} is already paused")
    try:
        await svc.mgr.pause(sandbox_id, caller=caller)
    except InvalidState as e:
        # 409 tells the SDK "already paused", which a busy sandbox is not
        raise InvalidRequest(e.message) from None
    svc.mgr.set_timeout(sandbox_id, MAX_TTL_S, caller=caller)  # kept paused until resumed or killed
    return Response(status_code=204)


async def resume(svc: E2BService, sandbox_id: str, caller: Caller, timeout: float) -> SandboxInfo:
    """Resume a paused sandbox with a fresh timeout."""
    info = await svc.mgr.resume(sandbox_id, caller=caller)
    return svc.mgr.set_timeout(info.id, timeout, caller=caller) if info.state == State.running else info


async def _connect(sandbox_id: str, svc: E2BService, caller: Caller, body: Any) -> Response:
    req: m.ConnectRequest = parse(m.ConnectRequest, body)
    if req.memory is False:
        raise InvalidRequest(NO_MEMORY)
    info = live_info(svc, sandbox_id, caller)
    resumed = info.state == State.paused
    if resumed:
        info = await resume(svc, sandbox_id, caller, float(req.timeout))
    elif info.expires_at.timestamp() - time.time() < req.timeout:  # a running one only gets longer
        svc.mgr.set_timeout(sandbox_id, float(req.timeout), caller=caller)
    return json_answer(sandbox_model(svc, info), 201 if resumed else 200)


_CONNECT = doc(200, m.Sandbox, m.ConnectRequest, also={201: m.Sandbox})  # 201: it was paused and is resumed


@router.post("/sandboxes/{sandbox_id}/connect", **_CONNECT)
@router.post("/v2/sandboxes/{sandbox_id}/connect", **_CONNECT)
@router.post("/sandboxes/{sandbox_id}/resume", **_CONNECT)
async def connect_sandbox(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    return await _connect(sandbox_id, svc, caller, body)
