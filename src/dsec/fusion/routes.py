"""The SandboxFusion API's routes: ``POST /run_code``, ``POST /run_jupyter`` and SandboxFusion's health
check ``GET /v1/ping``. Each route module keeps its own router; app.py includes them all."""

from __future__ import annotations

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


@router.post("/run_code", response_model=RunCodeResponse)
async def run_code(body: RunCodeRequest, request: Request) -> Any:
    name_caller(request.scope, OPERATOR)  # the audit's record: the calls run as the operator
    note(request.scope, command=["run_code", body.language])
    service: FusionService = request.app.state.fusion
    try:
        answer = await service.run_code(body)
    except Exception as e:  # every failure is an answer of SandboxFusion's shape, never a 500
        return answer_for(e)
    if answer.executor_pod_name is not None:
        note(request.scope, sandbox=answer.executor_pod_name)
    return JSONResponse(answer.model_dump(mode="json"))


@router.post("/run_jupyter", response_model=RunJupyterResponse)
async def run_jupyter(body: RunJupyterRequest, request: Request) -> Any:
    name_caller(request.scope, OPERATOR)
    note(request.scope, command=["run_jupyter", f"{len(body.cells)} cells"])
    service: FusionService = request.app.state.fusion
    try:
        answer = await service.run_jupyter(body)
    except Exception as e:  # every failure is an answer of SandboxFusion's shape, never a 500
        return answer_for(e)
    if answer.executor_pod_name is not None:
        note(request.scope, sandbox=answer.executor_pod_name)
    return JSONResponse(answer.model_dump(mode="json"))


@router.get("/v1/ping")
async def ping() -> str:
    return "pong"
