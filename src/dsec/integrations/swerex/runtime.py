"""``DsecRuntime``: SWE-ReX's ``AbstractRuntime`` on one dsec sandbox, through dsec's async SDK.

SWE-ReX's local runtime is the reference for what each call returns and raises. Each call opens its own
connection to the daemon and closes it before returning: SWE-agent runs every call in an
``asyncio.run`` of its own, and a connection (an httpx client) belongs to the event loop it was made on.
"""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import posixpath
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swerex.exceptions import (
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashInterruptAction,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.utils.log import get_logger

from dsec import AsyncClient, AsyncSandbox, DsecError, ExecResult, InvalidRequest

from .follow import MAX_EXEC
from .session import ShellSession

# What execute() keeps of each output stream (head and tail beyond it; the daemon allows up to 64 MiB)
DEFAULT_OUTPUT_LIMIT = 16 << 20


class DsecRuntime(AbstractRuntime):
    """A runtime on the dsec sandbox ``sandbox_id`` (``url``/``token``: the daemon; default ``DSEC_URL`` and
    ``DSEC_TOKEN``, else the local daemon). ``DsecDeployment`` makes one; so can anyone who has a sandbox."""

    def __init__(
        self,
        sandbox_id: str,
        *,
        url: str | None = None,
        token: str | None = None,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sandbox_id = sandbox_id
        self._url = url
        self._token = token
        self._output_limit = output_limit
        self._sessions: dict[str, ShellSession] = {}
        self.logger = logger or get_logger("rex-runtime")

    @property
    def sessions(self) -> dict[str, ShellSession]:
        return self._sessions

    @asynccontextmanager
    async def _sandbox(self) -> AsyncIterator[AsyncSandbox]:
        async with AsyncClient(self._url, self._token) as client:
            yield await AsyncSandbox.connect(self.sandbox_id, client=client)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Alive while the sandbox runs (not paused, stopped or gone) and the daemon answers in ``timeout``."""
        try:
            async with asyncio.timeout(timeout), self._sandbox() as sb:
                info = await sb.info()
        except TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"the dsec daemon did not answer within {timeout} s")
        except DsecError as e:
            return IsAliveResponse(is_alive=False, message=f"{type(e).__name__}: {e}")
        if info.state != "running":
            reason = f" ({info.reason})" if info.reason else ""
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox_id} is {info.state}{reason}")
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        session = ShellSession(request)
        async with self._sandbox() as sb:
            try:
                response = await session.start(sb)
            except Exception:
                await _quietly(session.close(sb))
                raise
        self._sessions[request.session] = session
        return response

    async def run_in_session(self, action: Action) -> Observation:
        session = self._sessions.get(action.session)
        if session is None:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        async with self._sandbox() as sb:
            if isinstance(action, BashInterruptAction):
                return await session.interrupt(sb, action)
            return await session.run(sb, action)

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        session = self._sessions.get(request.session)
        if session is None:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        async with self._sandbox() as sb:
            await session.close(sb)
        del self._sessions[request.session]
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """Runs a command outside any session, as ``subprocess.run`` would (``env`` replaces the whole
        environment; a signal's death is a negative exit code)."""
        argv = command_argv(command)
        timeout = MAX_EXEC if command.timeout is None else command.timeout
        async with self._sandbox() as sb:
            result = await sb.exec(argv, timeout=timeout, cwd=command.cwd, output_limit=self._output_limit)
        if result.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        _raise_spawn_failure(result, argv, command.cwd)
        exit_code = -result.signal if result.signal else result.exit_code
        response = CommandResponse(stdout=result.stdout, stderr=result.stderr, exit_code=exit_code)
        if command.check and exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {exit_code}. "
                f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """The file as ``Path.read_text`` reads it (UTF-8 unless ``encoding`` says otherwise, newlines
        translated); ``FileNotFoundError`` when it is missing."""
        async with self._sandbox() as sb:
            data = await sb.files.read(request.path)
        return ReadFileResponse(content=decode_text(data, request.encoding, request.errors))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Writes ``content`` (UTF-8), creating the missing parent directories."""
        async with self._sandbox() as sb:
            await _make_parent(sb, request.path)
            await sb.files.write(request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory into the sandbox. A directory's contents are merged into
        ``target_path`` (made if missing, as SWE-ReX's remote runtime unpacks them); a file lands at
        ``target_path``, or inside it when that is a directory (as ``shutil.copy`` does), with its mode."""
        source = await asyncio.to_thread(_Source.look, request.source_path)
        async with self._sandbox() as sb:
            if source.is_dir:
                await sb.files.upload_dir(source.path, request.target_path)
                return UploadResponse()
            target = request.target_path
            if await _is_dir(sb, target):
                target = posixpath.join(target, source.path.name)
            await _make_parent(sb, target)
            await sb.files.write(target, await asyncio.to_thread(source.path.read_bytes), mode=source.mode)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Closes every session (the sandbox stays: the deployment's stop() kills it)."""
        sessions, self._sessions = self._sessions, {}
        if sessions:
            try:
                async with self._sandbox() as sb:
                    for session in sessions.values():
                        await _quietly(session.close(sb))
            except DsecError as e:  # the sandbox is gone, and the shells with it
                self.logger.debug("closing the sessions of %s: %s", self.sandbox_id, e)
        return CloseResponse()


@dataclass(frozen=True)
class _Source:
    path: Path
    is_dir: bool
    mode: int

    @classmethod
    def look(cls, name: str) -> _Source:
        path = Path(name)
        if not path.exists() or not (path.is_dir() or path.is_file()):
            raise FileNotFoundError(errno.ENOENT, "no file or directory to upload", name)
        return cls(path, path.is_dir(), path.stat().st_mode & 0o7777)


def command_argv(command: Command) -> list[str]:
    """The argv ``subprocess.run`` would run for ``command``, with its stream merge and environment."""
    text = command.command
    if command.shell:
        # subprocess: with a list, the first item is the script and the rest its $0, $1, ...
        argv = ["/bin/sh", "-c", text] if isinstance(text, str) else ["/bin/sh", "-c", *text]
    else:
        argv = [text] if isinstance(text, str) else list(text)
    if command.merge_output_streams:
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
    if command.env is not None:
        argv = ["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), *argv]
    return argv


def decode_text(data: bytes, encoding: str | None, errors: str | None) -> str:
    with io.TextIOWrapper(io.BytesIO(data), encoding=encoding or "utf-8", errors=errors) as text:
        return text.read()


def _raise_spawn_failure(result: ExecResult, argv: list[str], cwd: str | None) -> None:
    """What subprocess raises where dsec reports that it could not start the command at all."""
    if result.stdout or result.exit_code not in (126, 127):
        return
    if result.stderr.startswith("dsec: cannot run "):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    if result.stderr.startswith("dsec: cannot change directory to "):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)


async def _make_parent(sb: AsyncSandbox, path: str) -> None:
    parent = posixpath.dirname(path)
    if parent and parent != "/":
        await sb.files.mkdir(parent)


async def _is_dir(sb: AsyncSandbox, path: str) -> bool:
    try:
        await sb.files.list(path)
    except (FileNotFoundError, InvalidRequest):  # missing, or not a directory
        return False
    return True


async def _quietly(call: Awaitable[object]) -> None:
    """A clean-up that must not hide the error it follows (the sandbox may be gone already)."""
    try:
        await call
    except (DsecError, OSError) as e:
        logging.getLogger("rex-runtime").debug("clean-up failed: %s", e)
