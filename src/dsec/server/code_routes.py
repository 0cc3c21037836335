"""Stateful code execution: run a cell in one of the sandbox's code contexts, list them, remove one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from ..protocol.code import CONTEXT_PATTERN, CodeContexts, CodeRequest, CodeResult
from ..web.audit import note
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)

ContextParam = Annotated[str, Path(pattern=CONTEXT_PATTERN)]


@router.post("/sandboxes/{sandbox_id}/code", response_model=CodeResult)
async def run_code(sandbox_id: str, body: CodeRequest, mgr: Mgr, caller: CallerDep, request: Request) -> CodeResult:
    """Run Python in a context of the sandbox (started on first use; its variables survive between calls).
    The code's own error is part of the answer (``error``), not an HTTP error."""
    note(request.scope, command=f"run_code[{body.context or 'default'}]")
    return await mgr.code.run(sandbox_id, body, caller=caller)


@router.get("/sandboxes/{sandbox_id}/code/contexts", response_model=CodeContexts)
async def list_contexts(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> CodeContexts:
    return CodeContexts(contexts=await mgr.code.contexts(sandbox_id, caller=caller))


@router.delete("/sandboxes/{sandbox_id}/code/contexts/{context}", status_code=204)
async def remove_context(sandbox_id: str, context: ContextParam, mgr: Mgr, caller: CallerDep) -> Response:
    """Stop the context's interpreter; its state is gone (a later call by its name starts it afresh)."""
    await mgr.code.remove(sandbox_id, context, caller=caller)
    return Response(status_code=204)
