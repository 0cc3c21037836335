"""``sb.run_code``: a cell of Python run in a context that lives in the sandbox.

Each call is one exec of the sandbox's ``python3`` with driver.py's source as an argument (nothing is
written into the sandbox first, so it works the same on every kind and in a function worker's emptied
/tmp): the driver hands the cell to the context's server, starting it on the first call. The context's
state is in that server (a Jupyter kernel where the image has one), not in the daemon, so it outlives a
daemon restart; the exec goes through the sandbox's one action path, so a trajectory records it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ...errors import BackendError, DsecError, InvalidRequest, InvalidState, QuotaExceeded
from ...protocol.code import DEFAULT_CONTEXT, MAX_CONTEXTS, CodeError, CodeRequest, CodeResult
from ...protocol.languages import CompileRunResult
from ...protocol.sandbox import MAX_EXEC_TIMEOUT_S, MAX_OUTPUT_CAP, ExecRequest, ExecResult
from ...tenancy import Caller
from ..actions import Actions
from ..compiled import compile_and_run
from ..files import FileActions
from ..lifecycle import Lifecycle

DRIVER = (Path(__file__).parent / "driver.py").read_text()
Live = Callable[[str, str], None]  # (stream name, text) of a cell's output as it is written
BOOT = "import sys; exec(sys.argv[1])"
START_BUDGET = 240.0  # the driver waits up to 180 s for a kernel to start; the rest is the exec's own cost
NO_SERVER, TOO_MANY = 3, 4  # the driver's exit statuses
NOT_FOUND = 127  # the shell's: no python3 in the image
ONCE_DIR = "/tmp/.dsec-once"  # where another language's source is compiled and run, a directory per call
STREAM_CAP = 1 << 20  # bytes kept per stream, as a cell's


def _argv(op: str, context: str) -> list[str]:
    return ["/bin/sh", "-c", f'exec python3 -c "$0" "$@" {MAX_CONTEXTS}', BOOT, DRIVER, op, context]


class CodeRunner:
    def __init__(self, actions: Actions, lifecycle: Lifecycle, files: FileActions) -> None:
        self.actions = actions
        self.lifecycle = lifecycle
        self.files = files
        self.user: str | None = None  # the account the code runs as; None: the image's

    def as_account(self, user: str | None) -> CodeRunner:
        """This runner, running code as ``user`` (each account's contexts are its own)."""
        other = copy.copy(self)
        other.user = user
        return other

    async def run(
        self,
        sandbox_id: str,
        req: CodeRequest,
        *,
        caller: Caller,
        env: dict[str, str] | None = None,
        quiet: bool = False,
        live: Live | None = None,
    ) -> CodeResult:
        """``env``: environment variables for this cell only; ``quiet``: a setup cell of the caller's (the E2B
        API's context cwd), not counted among the context's cells; ``live``: called with each piece of the
        cell's output (stream name, text) as the cell writes it (python only; the result has it all too)."""
        if req.language != "python":
            return await self.once(sandbox_id, req, caller=caller, env=env)
        context = req.context or DEFAULT_CONTEXT
        request: dict[str, Any] = {"op": "run", "code": req.code, "timeout": req.timeout}
        if env:
            request["env"] = env
        if quiet:
            request["quiet"] = True
        if live is not None:
            request["live"] = True
        body = json.dumps(request)
        started = time.monotonic()
        timeout = min(req.timeout + START_BUDGET, MAX_EXEC_TIMEOUT_S)
        lines = None if live is None else LiveLines(live)
        res = await self._exec(sandbox_id, "call", context, body, timeout, caller, lines)
        try:
            # the answer is the last line (a live request's output lines come before it)
            answer: dict[str, Any] = json.loads(res.stdout.rstrip("\n").rpartition("\n")[2])
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

    async def once(
        self, sandbox_id: str, req: CodeRequest, *, caller: Caller, env: dict[str, str] | None = None
    ) -> CodeResult:
        """Another language: compiled (if it is) and run once, in a directory of its own; no state is kept."""
        if req.context is not None:
            raise InvalidRequest(f"only python keeps a context; {req.language} code runs once (leave context unset)")
        started = time.monotonic()
        where = f"{ONCE_DIR}/{secrets.token_hex(6)}"
        await self.files.mkdir(sandbox_id, where, caller=caller)
        try:
            done = await compile_and_run(
                self.lifecycle,
                self.files,
                sandbox_id,
                req.language,
                req.code,
                compile_timeout=req.timeout,
                run_timeout=req.timeout,
                cwd=where,
                env=env,
                user=self.user,
                output_limit=STREAM_CAP,
                caller=caller,
            )
        finally:
            with contextlib.suppress(DsecError):
                await self.files.remove(sandbox_id, where, recursive=True, caller=caller)
        return once_result(done, req.timeout, time.monotonic() - started)

    async def contexts(self, sandbox_id: str, *, caller: Caller) -> list[str]:
        res = await self._exec(sandbox_id, "list", DEFAULT_CONTEXT, "", 60.0, caller)
        names: list[str] = json.loads(res.stdout)
        return names

    async def remove(self, sandbox_id: str, context: str, *, caller: Caller) -> bool:
        """Stop the context's interpreter (its state is gone); False if it was not running."""
        res = await self._exec(sandbox_id, "call", context, json.dumps({"op": "stop"}), 60.0, caller)
        stopped: bool = json.loads(res.stdout).get("stopped", False)
        return stopped

    async def interrupt(self, sandbox_id: str, context: str, *, caller: Caller) -> bool:
        """Interrupt the cell the context is running (as Jupyter's interrupt button); False if none could be
        told. Its caller gets the cell's answer with the error ``KeyboardInterrupt``; its variables are kept."""
        res = await self._exec(sandbox_id, "interrupt", context, "", 60.0, caller)
        sent: bool = json.loads(res.stdout).get("interrupted", False)
        return sent

    async def _exec(
        self,
        sandbox_id: str,
        op: str,
        context: str,
        stdin: str,
        timeout: float,
        caller: Caller,
        lines: LiveLines | None = None,
    ) -> ExecResult:
        req = ExecRequest(
            cmd=_argv(op, context), stdin=stdin, timeout=timeout, output_limit=MAX_OUTPUT_CAP, user=self.user
        )
        on_output = None if lines is None else lines.take
        res: ExecResult
        res, _ = await self.actions.call(sandbox_id, "exec", req, seq=None, caller=caller, on_output=on_output)
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


class LiveLines:
    """The driver's stdout as it arrives, cut into lines: each output line (``{"stream", "text"}``) goes to
    ``live``; the answer's line is read from the exec's result."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.partial: list[bytes] = []  # pieces of a line not ended yet (the answer's may be megabytes)

    def take(self, stream: str, chunk: bytes) -> None:
        if stream != "stdout":
            return
        if b"\n" not in chunk:
            self.partial.append(chunk)
            return
        *complete, rest = (b"".join(self.partial) + chunk).split(b"\n")
        self.partial = [rest]
        for line in complete:
            try:
                frame = json.loads(line)
            except ValueError:
                continue
            if isinstance(frame, dict) and isinstance(frame.get("stream"), str) and isinstance(frame.get("text"), str):
                self.live(frame["stream"], frame["text"])


def once_result(done: CompileRunResult, timeout: float, duration: float) -> CodeResult:
    """A compile-and-run as a cell's result: the run's output (the compiler's, if it failed), and an error
    for a compile that failed, a run past its time or one that did not exit with 0."""
    failed = next((s for s in (done.compile, done.run) if s is not None and s.status == "error"), None)
    if failed is not None:
        raise InvalidState(
            f"{done.language} cannot run in this image: {failed.stderr.strip()[:300]} (dsec/code:1 has it)"
        )
    step = done.run if done.run is not None else done.compile
    assert step is not None
    error: CodeError | None = None
    if step.status == "timeout":
        error = CodeError(name="TimeoutError", value=f"the code ran past its {timeout:g}s timeout and was killed")
    elif step is done.compile and step.exit_code != 0:
        error = CodeError(
            name="CompileError",
            value=f"the compiler exited with status {step.exit_code}",
            traceback=step.stderr.splitlines()[-50:],
        )
    elif step.exit_code != 0:
        how = f"signal {step.signal}" if step.signal else f"status {step.exit_code}"
        error = CodeError(
            name="ExitError", value=f"the program ended with {how}", traceback=step.stderr.splitlines()[-50:]
        )
    return CodeResult(
        stdout=step.stdout,
        stderr=step.stderr,
        error=error,
        context="",
        engine="process",
        truncated=step.truncated,
        duration=duration,
    )
