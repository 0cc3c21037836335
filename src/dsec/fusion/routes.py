"""The SandboxFusion API's routes: ``POST /run_code``, ``POST /run_jupyter`` and SandboxFusion's health
check ``GET /v1/ping``. Each route module keeps its own router; app.py includes them all."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..tenancy import OPERATOR
from ..web.audit import note
from ..web.auth import name_caller
from .errors import answer_for
from .models import RunCodeRequest, RunCodeResponse, RunJupyterRequest, RunJupyterResponse
from .service import FusionService

router = APIRouter()


async def _answer(request: Request, command: list[str], call: Awaitable[RunCodeResponse | RunJupyterResponse]) -> Any:
    """One call of either kind: audited as the operator's, every failure an answer of SandboxFusion's shape."""
    name_caller(request.scope, OPERATOR)  # the audit's record: the calls run as the operator
    note(request.scope, command=command)
    try:
        answer = await call
    except Exception as e:  # never a 500
        return answer_for(e)
    if answer.executor_pod_name is not None:
        note(request.scope, sandbox=answer.executor_pod_name)
    return JSONResponse(answer.model_dump(mode="json"))


def _service(request: Request) -> FusionService:
    service: FusionService = request.app.state.fusion
    return service


@router.post("/run_code", response_model=RunCodeResponse)
async def run_code(body: RunCodeRequest, request: Request) -> Any:
    return await _answer(request, ["run_code", body.language], _service(request).run_code(body))


@router.post("/run_jupyter", response_model=RunJupyterResponse)
async def run_jupyter(body: RunJupyterRequest, request: Request) -> Any:
    return await _answer(request, ["run_jupyter", f"{len(body.cells)} cells"], _service(request).run_jupyter(body))


@router.get("/v1/ping")
async def ping() -> str:
    return "pong"
