"""What a SandboxFusion call does with the core: a function-kind sandbox (a warm worker) for the call,
its files written, the code compiled and run (core/compiled.py), the files asked for read back, the
sandbox given back. Everything a sandbox is and does stays in the core; this only translates."""

from __future__ import annotations

import base64
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..core.compiled import compile_and_run, language
from ..core.manager import SandboxManager
from ..errors import DsecError, InvalidRequest, LimitExceeded, NotFound
from ..protocol.code import CodeRequest
from ..protocol.languages import CompileRunResult, StepResult
from ..protocol.sandbox import CreateSandbox, Limits
from ..tenancy import OPERATOR
from .models import (
    CellRunResult,
    CommandRunResult,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    run_path,
)

log = logging.getLogger("dsec.fusion")

DEFAULT_IMAGE = "dsec/code:1"
LABEL = "dsec.fusion"  # what every call's sandbox is labelled with
TTL_MARGIN = 60.0  # a call's sandbox lives this much longer than its compile and run may: files, teardown
KERNEL_START = 240.0  # a kernel's first start, beside the cells' own time: run_code's start budget
MAX_FETCH_TOTAL = 64 << 20  # bytes of fetched files in one answer (before base64)


@dataclass(frozen=True)
class FusionOptions:
    listen: str  # http://HOST:PORT
    image: str = DEFAULT_IMAGE

    @classmethod
    def of(cls, listen: str, image: str) -> FusionOptions:
        """From ``dsec serve``'s flags; a bad one raises InvalidRequest naming it."""
        url = urllib.parse.urlparse(listen)
        if url.scheme != "http" or not url.hostname or url.port is None or url.path not in ("", "/"):
            raise InvalidRequest(f"--sandbox-fusion-listen {listen!r}: expected http://HOST:PORT")
        if not image:
            raise InvalidRequest("--sandbox-fusion-image: give an image name")
        return cls(listen, image)


class FusionService:
    """The calls run as the operator: the API has no credentials (as SandboxFusion has none), so whoever
    reaches its listener may run code, each call in a fresh sandbox with no network."""

    def __init__(self, mgr: SandboxManager, options: FusionOptions) -> None:
        self.mgr = mgr
        self.options = options

    async def run_code(self, req: RunCodeRequest) -> RunCodeResponse:
        try:
            language(req.language)
        except InvalidRequest as e:  # before a sandbox is made for it
            return RunCodeResponse.sandbox_error(e.message)
        async with self._sandbox(req, req.compile_timeout + req.run_timeout) as sid:
            for path, data in req.file_bytes().items():
                await self.mgr.files.write_file(sid, path, data)
            result = await compile_and_run(
                self.mgr.lifecycle,
                self.mgr.files,
                sid,
                req.language,
                req.code,
                stdin=req.stdin,
                compile_timeout=req.compile_timeout,
                run_timeout=req.run_timeout,
            )
            files, left_out = await self._fetch(sid, req.fetch_files)
        return answer(result, files, left_out, sid, self.options.image)

    async def run_jupyter(self, req: RunJupyterRequest) -> RunJupyterResponse:
        """The cells in order in one fresh kernel (run_code's context in a function worker), each within
        ``cell_timeout`` (if set) and all within ``total_timeout``; the first one to run out ends the run."""
        if req.kernel != "python3":
            return RunJupyterResponse(
                status="SandboxError", message=f"kernel {req.kernel[:64]!r}: only python3 is served"
            )
        async with self._sandbox(req, req.total_timeout + KERNEL_START) as sid:
            for path, data in req.file_bytes().items():
                await self.mgr.files.write_file(sid, path, data)
            started = time.monotonic()
            cells, timed_out = await self._cells(sid, req, started)
            files, left_out = await self._fetch(sid, req.fetch_files)
        driver = CommandRunResult(
            status="TimeLimitExceeded" if timed_out else "Finished",
            execution_time=time.monotonic() - started,
            return_code=None if timed_out else 0,
        )
        message = (
            f"fetch_files left out (over {MAX_FETCH_TOTAL} bytes in all): {', '.join(left_out)}" if left_out else ""
        )
        return RunJupyterResponse(
            status="Failed" if timed_out else "Success",
            message=message,
            driver=driver,
            cells=cells,
            executor_pod_name=sid,
            files=files,
        )

    async def _cells(self, sid: str, req: RunJupyterRequest, started: float) -> tuple[list[CellRunResult], bool]:
        cells: list[CellRunResult] = []
        for code in req.cells:
            left = req.total_timeout - (time.monotonic() - started)
            if left <= 0:
                return cells, True
            timeout = min(req.cell_timeout, left) if req.cell_timeout > 0 else left
            r = await self.mgr.code.run(sid, CodeRequest(code=code, timeout=timeout), caller=OPERATOR)
            display = [*r.outputs, *([r.result] if r.result is not None else [])]
            error = (
                []
                if r.error is None
                else [{"ename": r.error.name, "evalue": r.error.value, "traceback": r.error.traceback}]
            )
            cells.append(CellRunResult(stdout=r.stdout, stderr=r.stderr, display=display, error=error))
            if r.error is not None and r.error.name == "TimeoutError":
                return cells, True
        return cells, False

    @contextlib.asynccontextmanager
    async def _sandbox(self, req: RunCodeRequest | RunJupyterRequest, seconds: float) -> AsyncIterator[str]:
        """A function-kind sandbox of the API's image for one call, given back (killed) after it."""
        life = self.mgr.lifecycle
        limits = Limits() if req.memory() is None else Limits(memory=req.memory())
        create = CreateSandbox(
            image=self.options.image,
            kind="function",
            limits=limits,
            timeout=seconds + TTL_MARGIN,
            labels={LABEL: "1"},
        )
        info = await life.create(create, caller=OPERATOR, persist=False)
        try:
            yield info.id
        finally:
            try:
                await life.kill(info.id)
            except DsecError as e:  # the answer stands; the sandbox is reaped by its time to live
                log.warning("%s: could not stop its sandbox: %s", info.id, e)

    async def _fetch(self, sandbox_id: str, paths: list[str]) -> tuple[dict[str, str], list[str]]:
        """The regular files among ``paths`` (keyed as asked), base64; those past MAX_FETCH_TOTAL left out
        and named. Missing files and directories are left out silently, as SandboxFusion leaves them."""
        files: dict[str, str] = {}
        left_out: list[str] = []
        total = 0
        for path in paths:
            where = run_path(path)
            try:
                # a regular file's size first, so a big one is not read only to be dropped
                entry = await self.mgr.files.stat(sandbox_id, where)
                if entry.type == "file" and total + entry.size > MAX_FETCH_TOTAL:
                    left_out.append(path)
                    continue
                data = await self.mgr.files.read_file(sandbox_id, where)  # refuses what is not a regular file
            except LimitExceeded:
                left_out.append(path)
                continue
            except (NotFound, InvalidRequest):  # absent, a directory, a device, a dangling link
                continue
            if total + len(data) > MAX_FETCH_TOTAL:
                left_out.append(path)
                continue
            total += len(data)
            files[path] = base64.b64encode(data).decode()
        return files, left_out


def command_result(step: StepResult) -> CommandRunResult:
    if step.status == "timeout":
        return CommandRunResult(
            status="TimeLimitExceeded", execution_time=step.duration, stdout=step.stdout, stderr=step.stderr
        )
    # a signal's death as subprocess (and so SandboxFusion) reports it: minus the signal's number
    code = -step.signal if step.signal else step.exit_code
    return CommandRunResult(
        status="Error" if step.status == "error" else "Finished",
        execution_time=step.duration,
        return_code=code,
        stdout=step.stdout,
        stderr=step.stderr,
    )


def answer(
    result: CompileRunResult, files: dict[str, str], left_out: list[str], sandbox_id: str, image: str
) -> RunCodeResponse:
    """SandboxFusion's answer: SandboxError if a step could not start, Failed if one timed out or ended
    with a status other than 0, else Success."""
    steps = [s for s in (result.compile, result.run) if s is not None]
    status: RunStatus = "Success"
    message = ""
    if any(s.status == "error" for s in steps):
        failed = next(s for s in steps if s.status == "error")
        status = "SandboxError"
        message = f"{failed.stderr.strip()} (in the image {image}; dsec/code:1 has every language)"
    elif any(s.status == "timeout" or s.exit_code != 0 for s in steps):
        status = "Failed"
    if left_out:
        message = (message + "; " if message else "") + (
            f"fetch_files left out (over {MAX_FETCH_TOTAL} bytes in all): {', '.join(left_out)}"
        )
    return RunCodeResponse(
        status=status,
        message=message,
        compile_result=command_result(result.compile) if result.compile is not None else None,
        run_result=command_result(result.run) if result.run is not None else None,
        executor_pod_name=sandbox_id,
        files=files,
    )
