"""The ``e2b-code-interpreter`` package's server API (``/execute``, ``/contexts``) on dsec's code contexts.

The package talks to port 49999 of the sandbox (code_interpreter_port.py brings those requests here,
under ``PREFIX``). Each call becomes a call of dsec's code runner (core/code/), which runs the cell in a
context that lives in the sandbox, as ``sb.run_code`` does; nothing of E2B's runs in the sandbox.

- ``/execute`` runs a cell in a context (the default one, or ``context_id``) or, for another language
  than python, once. The package bounds a cell by its own read timeout and closes the connection at it:
  dsec then interrupts the cell, as Jupyter's interrupt button does (the context keeps its variables), so
  the context's next cell does not wait behind it. dsec's own bound is its longest exec (24 h).
- A context's id is a dsec context name (a UUID); its language and working directory are kept here, per
  daemon; a context the daemon does not know (after a restart) is listed as python in the default
  directory, which is the home of the image's default account.
- The code runs as root, as E2B's Jupyter server runs its kernels: the API's caller may run anything as
  root in the sandbox already (``user="root"``), so this gives no one more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.code import CodeRunner
from ..errors import DsecError, InvalidRequest, InvalidState, NotFound, SandboxGone, SandboxNotFound
from ..protocol.code import CONTEXT_PATTERN, DEFAULT_CONTEXT, CodeError, CodeRequest, CodeResult
from ..protocol.sandbox import MAX_EXEC_TIMEOUT_S, TERMINAL_STATES, ExecRequest, ExecResult
from ..store.records import SandboxRecord
from ..tenancy import Caller
from ..web.audit import note
from ..web.auth import name_caller
from .auth import owner_caller
from .code_interpreter_port import MARK, PREFIX
from .code_interpreter_stream import CellStream, Dropped, Output, disconnected
from .code_interpreter_wire import ContextOut, CreateContextBody, ExecuteBody, check_env, execution_lines, language
from .errors import GONE_TEMPLATE
from .service import E2BOptions, E2BService

TEMPLATE = "code-interpreter-v1"  # e2b_code_interpreter.constants.DEFAULT_TEMPLATE
IMAGE = "dsec/e2b-code-interpreter:1"
TEMPLATES: dict[str, tuple[str, str | None]] = {TEMPLATE: (IMAGE, None)}
ACCOUNT = "root"  # E2B's Jupyter server and its kernels run as root, whatever account commands default to
SETUP_TIMEOUT = 60.0
INTERRUPTED_GRACE = 15.0  # seconds an interrupted cell has to end before its exec is cancelled
ENDED_POLLS = 100  # tenths of a second a gone sandbox's teardown may take before its calls' answers drop
SHELLS = ("bash", "sh")  # run as commands in the context's directory, not in a directory of their own
CONTEXT_NAME = re.compile(CONTEXT_PATTERN)
router = APIRouter(prefix=PREFIX, include_in_schema=False)


def with_template(options: E2BOptions) -> E2BOptions:
    """The package's template is dsec/e2b-code-interpreter:1, unless ``--e2b-template`` names it otherwise."""
    return dataclasses.replace(options, templates={**TEMPLATES, **options.templates})


@dataclass(frozen=True)
class Context:
    language: str
    cwd: str


@dataclass
class Target:
    svc: E2BService
    rec: SandboxRecord
    caller: Caller

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def code(self) -> CodeRunner:
        return self.svc.mgr.code.as_account(ACCOUNT)


class Contexts:
    """What E2B says of a context that dsec's contexts do not hold (its language, its directory), per
    sandbox; forgotten with the sandbox."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, dict[str, Context]] = {}

    def get(self, sandbox_id: str, context_id: str) -> Context | None:
        return self._by_sandbox.get(sandbox_id, {}).get(context_id)

    def put(self, svc: E2BService, sandbox_id: str, context_id: str, ctx: Context) -> None:
        for sid in [s for s in self._by_sandbox if not svc.mgr.is_live(s)]:
            del self._by_sandbox[sid]
        self._by_sandbox.setdefault(sandbox_id, {})[context_id] = ctx

    def ids(self, sandbox_id: str) -> list[str]:
        """The sandbox's contexts made through this API, oldest first."""
        return list(self._by_sandbox.get(sandbox_id, {}))

    def drop(self, sandbox_id: str, context_id: str) -> bool:
        return self._by_sandbox.get(sandbox_id, {}).pop(context_id, None) is not None


def _contexts(request: Request) -> Contexts:
    state = request.app.state
    if not hasattr(state, "e2b_code_contexts"):
        state.e2b_code_contexts = Contexts()
    found: Contexts = state.e2b_code_contexts
    return found


def _target(request: Request) -> Target:
    """The sandbox the request came for on its port 49999 (its traffic token was checked on the way)."""
    sandbox_id = request.scope.get(MARK)
    if not isinstance(sandbox_id, str):
        raise StarletteHTTPException(404, "Not Found")
    svc: E2BService = request.app.state.e2b
    try:
        rec = svc.mgr.record(sandbox_id)
    except SandboxNotFound:
        rec = None
    if rec is None or rec.state in TERMINAL_STATES:  # as E2B's proxy answers for a sandbox that is gone
        raise StarletteHTTPException(502, GONE_TEMPLATE.format(id=sandbox_id[:64]))
    caller = owner_caller(rec.owner)
    name_caller(request.scope, caller)
    note(request.scope, sandbox=rec.id)
    return Target(svc, rec, caller)


async def _default_cwd(t: Target) -> str:
    return (await t.svc.account(t.rec, None, t.caller)).home


def _check_id(context_id: str) -> str:
    if not CONTEXT_NAME.fullmatch(context_id):
        raise NotFound(f"no code context {context_id[:80]!r}")
    return context_id


async def _known(t: Target, contexts: Contexts, context_id: str) -> bool:
    """The context is one of the sandbox's: made through this API, or running there."""
    if contexts.get(t.id, _check_id(context_id)) is not None:
        return True
    return context_id in await t.code.contexts(t.id, caller=t.caller)


async def _start(t: Target, context_id: str, cwd: str) -> None:
    """Start the context in ``cwd`` (a setup cell that is not counted among its cells)."""
    code = f"__import__('os').chdir({cwd!r})"
    req = CodeRequest(code=code, context=context_id, timeout=SETUP_TIMEOUT)
    res = await t.code.run(t.id, req, caller=t.caller, quiet=True)
    if res.error is not None:
        with contextlib.suppress(DsecError):
            await t.code.remove(t.id, context_id, caller=t.caller)
        raise InvalidRequest(f"the context cannot start in {cwd!r}: {res.error.name}: {res.error.value}")


@router.post("/contexts")
async def create_context(body: CreateContextBody, request: Request) -> ContextOut:
    t = _target(request)
    if language(body.language) != "python":
        raise InvalidRequest(
            f"only python keeps a context on dsec; run {body.language} code without one (run_code(code, "
            "language=...)): each run starts afresh"
        )
    cwd = body.cwd or await _default_cwd(t)
    context_id = str(uuid.uuid4())
    await _start(t, context_id, cwd)
    _contexts(request).put(t.svc, t.id, context_id, Context("python", cwd))
    return ContextOut(id=context_id, language="python", cwd=cwd)


@router.get("/contexts")
async def list_contexts(request: Request) -> list[ContextOut]:
    """The default context first (it is there before its first cell, as E2B's are), then those made
    through this API in the order they were made, then any others the sandbox runs."""
    t = _target(request)
    contexts = _contexts(request)
    live = set(await t.code.contexts(t.id, caller=t.caller))
    default = await _default_cwd(t)
    made = [c for c in contexts.ids(t.id) if c in live]
    names = [DEFAULT_CONTEXT, *made, *sorted(live - {DEFAULT_CONTEXT, *made})]
    out = []
    for name in names:
        ctx = contexts.get(t.id, name) or Context("python", default)
        out.append(ContextOut(id=name, language=ctx.language, cwd=ctx.cwd))
    return out


@router.delete("/contexts/{context_id}")
async def remove_context(context_id: str, request: Request) -> Response:
    t = _target(request)
    stopped = await t.code.remove(t.id, _check_id(context_id), caller=t.caller)
    if not _contexts(request).drop(t.id, context_id) and not stopped:
        raise NotFound(f"no code context {context_id!r} in sandbox {t.id}")
    return Response(status_code=204)


@router.post("/contexts/{context_id}/restart")
async def restart_context(context_id: str, request: Request) -> Response:
    """A fresh interpreter in the context's directory: its variables are gone."""
    t = _target(request)
    contexts = _contexts(request)
    known = contexts.get(t.id, _check_id(context_id))
    stopped = await t.code.remove(t.id, context_id, caller=t.caller)
    if known is None and not stopped:
        raise NotFound(f"no code context {context_id!r} in sandbox {t.id}")
    if context_id != DEFAULT_CONTEXT:  # the default one starts again on its next cell, where it started
        await _start(t, context_id, known.cwd if known is not None else await _default_cwd(t))
    return Response(status_code=204)


@router.post("/execute")
async def execute(body: ExecuteBody, request: Request) -> Response:
    t = _target(request)
    lang = language(body.language)
    context: str | None = None
    if body.context_id is not None:
        if not await _known(t, _contexts(request), body.context_id):
            raise NotFound(f"no code context {body.context_id!r} in sandbox {t.id}")
        context, lang = body.context_id, "python"
    req = CodeRequest(code=body.code, language=lang, context=context, timeout=MAX_EXEC_TIMEOUT_S)
    stateful = lang == "python"
    note(request.scope, command=f"run_code[{(context or DEFAULT_CONTEXT) if stateful else lang}]")
    env = check_env(body.env_vars)
    output: Output = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def live(stream: str, text: str) -> None:
        loop.call_soon_threadsafe(output.put_nowait, (stream, text))

    if lang in SHELLS:
        cwd = await _default_cwd(t)
        run = asyncio.create_task(_shell(t, lang, body.code, env, cwd))
    else:
        run = asyncio.create_task(t.code.run(t.id, req, caller=t.caller, env=env, live=live))
    first = asyncio.ensure_future(output.get())
    left = asyncio.create_task(disconnected(request.receive))
    try:
        await asyncio.wait({run, first, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not first.done() or run.done():
            first.cancel()
    stopping = (context or DEFAULT_CONTEXT) if stateful else None
    if run.done() and isinstance(run.exception(), SandboxGone):
        return Dropped(lambda: _ended(t))
    if run.done():  # an error of the call is the answer's status; its output is in the result
        return Response(execution_lines(run.result(), stateful), media_type="application/x-ndjson")
    if first.done():  # the cell writes while it runs: its lines go out as they come
        return CellStream(first.result(), output, run, lambda: _abandon(t, run, stopping), lambda: _ended(t))
    await _abandon(t, run, stopping)  # the client gave up (its timeout): the answer is nobody's
    return Response(status_code=499)


async def _ended(t: Target) -> None:
    """Until the sandbox's record says it is over (a kill's teardown runs on after its agent is gone)."""
    for _ in range(ENDED_POLLS):
        try:
            if t.svc.mgr.record(t.id).state in TERMINAL_STATES:
                return
        except SandboxNotFound:
            return
        await asyncio.sleep(0.1)


async def _shell(t: Target, shell: str, code: str, env: dict[str, str] | None, cwd: str) -> CodeResult:
    """bash or sh code: run once, as E2B's bash runs, in the context's directory (the account's home)."""
    req = ExecRequest(
        cmd=[shell, "-c", code], env=env or {}, cwd=cwd, user=ACCOUNT, timeout=MAX_EXEC_TIMEOUT_S, output_limit=1 << 20
    )
    res: ExecResult
    res, _ = await t.svc.mgr.actions.call(t.id, "exec", req, seq=None, caller=t.caller)
    if res.exit_code == 127 and not res.stdout and f"{shell}: not found" in res.stderr:
        raise InvalidState(f"the sandbox's image has no {shell}")
    error = None
    if res.exit_code != 0:
        how = f"status {res.exit_code}" if res.exit_code is not None else f"signal {res.signal}"
        tb = res.stderr.splitlines()[-50:]
        error = CodeError(name="ExitError", value=f"the command ended with {how}", traceback=tb)
    return CodeResult(
        stdout=res.stdout, stderr=res.stderr, error=error, context="", engine="process", truncated=res.truncated
    )


async def _abandon(t: Target, run: asyncio.Task[CodeResult], context: str | None) -> None:
    """Stop a cell whose caller went away: a python cell (``context``) is interrupted and its context kept;
    a run of another language is cancelled, which kills it."""
    if context is None:
        run.cancel()
    else:
        with contextlib.suppress(DsecError):
            await t.code.interrupt(t.id, context, caller=t.caller)
    with contextlib.suppress(asyncio.CancelledError, DsecError, TimeoutError):
        await asyncio.wait_for(run, INTERRUPTED_GRACE)
