"""Pulling registry images onto the node (issue 21)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..images.pull_progress import PullProgress as PullState
from ..protocol.pull import PullEvent, PullProgress, PullRequest, PushRequest, PushResult
from .auth import CallerDep
from .routes import _ERRORS, Mgr, _bytes
from .streaming import event_stream

router = APIRouter(prefix="/v1", responses=_ERRORS)


@router.post(
    "/images/pull",
    response_class=StreamingResponse,
    responses={
        200: _bytes("application/x-ndjson", "PullEvent lines: progress as it goes, then the image or an error.")
    },
)
async def pull_image(body: PullRequest, mgr: Mgr, caller: CallerDep) -> StreamingResponse:
    """Pull a registry image onto the node: its layers fetched and converted once for every image that
    shares them, then published under the reference's full name. Newline-delimited PullEvent JSON."""

    async def work(send: Callable[[PullEvent], None]) -> None:
        def progress(p: PullState) -> None:
            send(PullEvent(type="progress", progress=wire_progress(p)))

        image = await mgr.images.pull(body.reference, policy=body.policy, progress=progress)
        send(PullEvent(type="result", image=image))

    return event_stream(work, lambda error: PullEvent(type="error", error=error), f"pull of {body.reference}")


@router.post("/images/push", response_model=PushResult)
async def push_image(body: PushRequest, mgr: Mgr, caller: CallerDep) -> PushResult:
    """Push a dsec image to an OCI registry as a standard image (docker pull and podman pull run it)."""
    return await mgr.push_image(body, caller=caller)


def wire_progress(p: PullState) -> PullProgress:
    phase: str = p.phase
    if phase == "layers":  # the busiest layer's phase says more than "layers"
        busy = [x.phase for x in p.layers if not x.finished]
        phase = "converting" if "converting" in busy else "fetching" if busy else "publishing"
    return PullProgress(
        phase=phase,
        layers=p.layers_total,
        layers_done=p.layers_done,
        layers_reused=p.layers_reused,
        bytes_total=p.bytes_total,
        bytes_fetched=p.bytes_fetched,
    )
