"""``sb.run_code``: a cell of Python run in a context that lives in the sandbox.

Each call is one exec of the sandbox's ``python3`` with driver.py's source as an argument (nothing is
written into the sandbox first, so it works the same on every kind and in a function worker's emptied
/tmp): the driver hands the cell to the context's server, starting it on the first call. The context's
state is in that server (a Jupyter kernel where the image has one), not in the daemon, so it outlives a
daemon restart; the exec goes through the sandbox's one action path, so a trajectory records it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ...errors import BackendError, InvalidState, QuotaExceeded
from ...protocol.code import DEFAULT_CONTEXT, MAX_CONTEXTS, CodeError, CodeRequest, CodeResult
from ...protocol.sandbox import MAX_EXEC_TIMEOUT_S, MAX_OUTPUT_CAP, ExecRequest, ExecResult
from ...tenancy import Caller
from ..actions import Actions

DRIVER = (Path(__file__).parent / "driver.py").read_text()
BOOT = "import sys; exec(sys.argv[1])"
START_BUDGET = 240.0  # the driver waits up to 180 s for a kernel to start; the rest is the exec's own cost
NO_SERVER, TOO_MANY = 3, 4  # the driver's exit statuses
NOT_FOUND = 127  # the shell's: no python3 in the image


def _argv(op: str, context: str) -> list[str]:
    return ["/bin/sh", "-c", f'exec python3 -c "$0" "$@" {MAX_CONTEXTS}', BOOT, DRIVER, op, context]


class CodeRunner:
    def __init__(self, actions: Actions) -> None:
        self.actions = actions

    async def run(self, sandbox_id: str, req: CodeRequest, *, caller: Caller) -> CodeResult:
        context = req.context or DEFAULT_CONTEXT
        body = json.dumps({"op": "run", "code": req.code, "timeout": req.timeout})
        started = time.monotonic()
        res = await self._exec(
            sandbox_id, "call", context, body, min(req.timeout + START_BUDGET, MAX_EXEC_TIMEOUT_S), caller
        )
        try:
            answer: dict[str, Any] = json.loads(res.stdout)
            error = answer.pop("error")
            return CodeResult(
                **answer,
                error=None if error is None else CodeError.model_validate(error),
                context=context,
                duration=time.monotonic() - started,
            )
        except (ValueError, KeyError, ValidationError):
            # the server died mid-cell (the code ended its process): the next call starts a fresh one
            raise BackendError(
                f"the code context {context!r} ended while running the code; its state is lost "
                f"(stderr: {res.stderr[-500:]!r})"
            ) from None

    async def contexts(self, sandbox_id: str, *, caller: Caller) -> list[str]:
        res = await self._exec(sandbox_id, "list", DEFAULT_CONTEXT, "", 60.0, caller)
        names: list[str] = json.loads(res.stdout)
        return names

    async def remove(self, sandbox_id: str, context: str, *, caller: Caller) -> bool:
        """Stop the context's interpreter (its state is gone); False if it was not running."""
        res = await self._exec(sandbox_id, "call", context, json.dumps({"op": "stop"}), 60.0, caller)
        stopped: bool = json.loads(res.stdout).get("stopped", False)
        return stopped

    async def _exec(
        self, sandbox_id: str, op: str, context: str, stdin: str, timeout: float, caller: Caller
    ) -> ExecResult:
        req = ExecRequest(cmd=_argv(op, context), stdin=stdin, timeout=timeout, output_limit=MAX_OUTPUT_CAP)
        res: ExecResult
        res, _ = await self.actions.call(sandbox_id, "exec", req, seq=None, caller=caller)
        if res.exit_code == 0:
            return res
        if res.exit_code == NOT_FOUND:
            raise InvalidState(
                f"the sandbox's image has no python3, which run_code needs (the image {'dsec/code:1'!r} has "
                "Python with a Jupyter kernel)"
            )
        if res.exit_code == TOO_MANY:
            raise QuotaExceeded(f"the sandbox holds {MAX_CONTEXTS} code contexts already; remove one first")
        detail = (res.stderr or res.stdout)[-2000:]
        if res.exit_code == NO_SERVER:
            raise BackendError(f"the code context {context!r} could not start: {detail}")
        raise BackendError(f"run_code's driver ended with status {res.exit_code} (signal {res.signal}): {detail}")
