"""envd's ``process.Process`` service (the SDK's ``sbx.commands`` and ``sbx.pty``) on the core's process
table: every command is an exec of the core, with its limits, output caps, timeout and host-side exit
status; a command outlives the stream that started it (background commands), and can be listed,
re-attached to, fed standard input and signalled. A command started with ``pty`` runs on a
pseudo-terminal the kind makes inside the sandbox: its input and output are the terminal's (``pty``
bytes both ways) and ``Update`` resizes it."""

from __future__ import annotations

import asyncio
import signal as signals
from collections.abc import AsyncIterator

from pydantic import ValidationError

from ..core.processes import Output, Process, Subscription
from ..errors import InvalidRequest, InvalidState, SandboxGone, SandboxNotFound, validation_message
from ..protocol.sandbox import MAX_EXEC_TIMEOUT_S, TERMINAL_STATES, ExecRequest, ExecResult
from ..protocol.terminal import PtySize
from ..web.audit import note
from . import envd_models as pm
from .connect import RpcError, StreamCut
from .envd import Call, client_stream, server_stream, unary
from .service import E2BService

# how long a stream whose sandbox went away waits for the sandbox's end to be on record before it is cut
SETTLE_S = 10.0
SETTLE_POLL_S = 0.05


def end_event(result: ExecResult) -> pm.EndEvent:
    """The end of a command as envd reports it (Go's os.ProcessState: -1 and "signal: killed" for a signal)."""
    error = (
        "the command was killed by the out-of-memory killer (the sandbox's memory limit)" if result.oom_killed else None
    )
    if result.signal is not None:
        try:
            name = signals.strsignal(result.signal) or f"signal {result.signal}"
        except ValueError:
            name = f"signal {result.signal}"
        return pm.EndEvent(exit_code=-1, exited=False, status=f"signal: {name.lower()}", error=error)
    if result.exit_code is None:
        return pm.EndEvent(exit_code=-1, exited=False, status="unknown", error=error or "the exit status is unknown")
    return pm.EndEvent(exit_code=result.exit_code, exited=True, status=f"exit status {result.exit_code}", error=error)


async def _cut(call: Call) -> StreamCut:
    """The sandbox went away under a running command: its stream is cut as E2B's is when its sandbox
    dies, so that the SDK asks the sandbox's health and reports it killed (an error message would be
    reported as a timeout). The cut waits, a bounded while, until the sandbox's end is on record: the
    health answer must already say it is gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while loop.time() < deadline:
        try:
            if call.svc.mgr.record(call.sandbox_id).state in TERMINAL_STATES:
                break
        except SandboxNotFound:
            break
        await asyncio.sleep(SETTLE_POLL_S)
    return StreamCut()


async def _events(call: Call, sub: Subscription) -> AsyncIterator[pm.ProcessEvent]:
    """A process's events from a subscription: output, keepalives while it is quiet, then its end."""
    keepalive = call.keepalive()
    try:
        while True:
            event = await sub.next(keepalive)
            if event is None:
                yield pm.ProcessEvent(keepalive=pm.KeepAlive())
            elif isinstance(event, Output):
                if sub.proc.terminal:
                    data = pm.DataEvent(pty=event.data)
                elif event.stream == "stdout":
                    data = pm.DataEvent(stdout=event.data)
                else:
                    data = pm.DataEvent(stderr=event.data)
                yield pm.ProcessEvent(data=data)
            elif isinstance(event.error, SandboxGone):
                raise await _cut(call)
            elif event.error is not None:
                raise event.error
            elif event.result is not None and event.result.timed_out:
                res = event.result
                what = "idle timeout (no output)" if res.idle_timed_out else "timeout"
                raise RpcError("deadline_exceeded", f"the command was killed by its {what} after {res.duration:.1f} s")
            else:
                assert event.result is not None
                yield pm.ProcessEvent(end=end_event(event.result))
                return
    finally:
        sub.close()


def _timeout(call: Call) -> float:
    """The command's timeout: the stream's own (the SDK's ``timeout``), or none (the longest an exec may run)."""
    ms = call.timeout_ms()
    return MAX_EXEC_TIMEOUT_S if not ms else min(MAX_EXEC_TIMEOUT_S, ms / 1000)


def _find(call: Call, selector: pm.ProcessSelector) -> Process:
    if selector.pid is None and selector.tag is None:
        raise RpcError("invalid_argument", "a process selector needs a pid or a tag")
    return call.svc.mgr.processes.find(call.sandbox_id, caller=call.caller, pid=selector.pid, tag=selector.tag)


def _size(pty: pm.PTY) -> PtySize:
    try:
        return PtySize(rows=pty.size.rows, cols=pty.size.cols)
    except ValidationError as e:
        raise RpcError("invalid_argument", f"pty.size: {validation_message(e)}") from None


@server_stream("/process.Process/Start", pm.StartRequest)
async def start(call: Call, req: pm.StartRequest) -> AsyncIterator[pm.StartResponse]:
    size = _size(req.pty) if req.pty is not None else None
    cfg = req.process
    if not cfg.cmd:
        raise RpcError("invalid_argument", "process.cmd is empty")
    svc: E2BService = call.svc
    note(call.request.scope, command=[cfg.cmd, *cfg.args])
    acct = await svc.account(call.rec, call.basic_user(), call.caller)
    cwd = svc.absolute(cfg.cwd, acct.home) if cfg.cwd else acct.home
    try:
        exec_req = ExecRequest(cmd=[cfg.cmd, *cfg.args], env=cfg.envs, cwd=cwd, user=acct.spec, timeout=_timeout(call))
    except ValidationError as e:
        raise RpcError("invalid_argument", validation_message(e)) from None
    stdin = bool(req.stdin)
    if (stdin or size is not None) and call.rec.trajectory:
        what = "a terminal" if size is not None else "a command fed standard input while it runs"
        raise InvalidState(
            f"sandbox {call.sandbox_id} is bound to a trajectory: {what} cannot be recorded; pass the input "
            "in the command (e.g. a here-document) instead"
        )
    seq = await svc.position(call.rec)
    proc, sub = await svc.mgr.processes.start(
        call.sandbox_id, exec_req, caller=call.caller, stdin=stdin, tag=req.tag, seq=seq, pty=size
    )
    try:
        yield pm.StartResponse(event=pm.ProcessEvent(start=pm.StartEvent(pid=proc.pid)))
        async for event in _events(call, sub):
            yield pm.StartResponse(event=event)
    finally:
        sub.close()


@server_stream("/process.Process/Connect", pm.ConnectRequest)
async def reconnect(call: Call, req: pm.ConnectRequest) -> AsyncIterator[pm.ConnectResponse]:
    proc = _find(call, req.process)
    sub = proc.subscribe()
    try:
        yield pm.ConnectResponse(event=pm.ProcessEvent(start=pm.StartEvent(pid=proc.pid)))
        async for event in _events(call, sub):
            yield pm.ConnectResponse(event=event)
    finally:
        sub.close()


@unary("/process.Process/List", pm.ListRequest)
async def list_processes(call: Call, req: pm.ListRequest) -> pm.ListResponse:
    out = []
    for proc in call.svc.mgr.processes.list(call.sandbox_id, caller=call.caller):
        argv = proc.req.argv()
        config = pm.ProcessConfig(cmd=argv[0], args=argv[1:], envs=dict(proc.req.env), cwd=proc.req.cwd)
        out.append(pm.ProcessInfo(config=config, pid=proc.pid, tag=proc.tag))
    return pm.ListResponse(processes=out)


def _feed(proc: Process, data: pm.ProcessInput) -> None:
    """Standard input, or a terminal's input: a terminal takes both (typed on it), and a command without
    one refuses terminal input."""
    if data.pty is not None and not proc.terminal:
        raise RpcError("failed_precondition", f"process {proc.pid} does not run on a terminal: send it stdin")
    proc.io.feed(data.pty if data.pty is not None else data.stdin or b"")


@unary("/process.Process/SendInput", pm.SendInputRequest)
async def send_input(call: Call, req: pm.SendInputRequest) -> pm.SendInputResponse:
    _feed(_find(call, req.process), req.input)
    return pm.SendInputResponse()


@client_stream("/process.Process/StreamInput", pm.StreamInputRequest)
async def stream_input(call: Call, messages: AsyncIterator[pm.StreamInputRequest]) -> pm.StreamInputResponse:
    proc: Process | None = None
    async for msg in messages:
        if msg.start is not None:
            proc = _find(call, msg.start.process)
        elif msg.data is not None:
            if proc is None:
                raise RpcError("invalid_argument", "the input stream must start with a start event naming the process")
            _feed(proc, msg.data.input)
    return pm.StreamInputResponse()


@unary("/process.Process/SendSignal", pm.SendSignalRequest)
async def send_signal(call: Call, req: pm.SendSignalRequest) -> pm.SendSignalResponse:
    if req.signal == pm.Signal.SIGNAL_UNSPECIFIED:
        raise RpcError("invalid_argument", "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL")
    proc = _find(call, req.process)
    try:
        proc.io.send_signal(int(req.signal))
    except InvalidState:
        # it ended between the lookup and the signal: for the caller, no such process any more
        raise RpcError("not_found", f"process {proc.pid} has ended") from None
    return pm.SendSignalResponse()


@unary("/process.Process/CloseStdin", pm.CloseStdinRequest)
async def close_stdin(call: Call, req: pm.CloseStdinRequest) -> pm.CloseStdinResponse:
    _find(call, req.process).io.close_stdin()
    return pm.CloseStdinResponse()


@unary("/process.Process/Update", pm.UpdateRequest)
async def update(call: Call, req: pm.UpdateRequest) -> pm.UpdateResponse:
    """A terminal's new size (an update without ``pty`` changes nothing)."""
    proc = _find(call, req.process)
    if req.pty is None:
        return pm.UpdateResponse()
    size = _size(req.pty)
    try:
        proc.resize(size)
    except InvalidRequest:
        raise RpcError("failed_precondition", f"process {proc.pid} does not run on a terminal") from None
    except InvalidState:
        raise RpcError("not_found", f"process {proc.pid} has ended") from None
    return pm.UpdateResponse()
