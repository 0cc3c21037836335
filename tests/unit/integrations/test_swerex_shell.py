"""The SWE-ReX session protocol end to end on this machine: ShellSession and its driver script, with a
stand-in for the sandbox that runs each exec as a local process group and kills the group when its
stream is left early, as the daemon kills a cancelled exec's cgroup. (tests/integration/test_swerex.py
runs the same through a real daemon.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionNotInitializedError,
)
from swerex.runtime.abstract import BashAction, BashInterruptAction, CreateBashSessionRequest

from dsec import ExecResult
from dsec.integrations.swerex.session import ShellSession

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine"),
    pytest.mark.timeout(60),
]


@dataclass
class Event:
    type: str
    data: str | None = None
    result: ExecResult | None = None


class LocalExecs:
    """Runs commands here, each in a process group of its own."""

    async def exec(self, cmd: str | list[str], *, timeout: float = 60.0, stdin: str | None = None) -> ExecResult:
        out: dict[str, str] = {"stdout": "", "stderr": ""}
        result = ExecResult()
        async for event in self.exec_stream(cmd, timeout=timeout, stdin=stdin):
            if event.type in out and event.data:
                out[event.type] += event.data
            elif event.result is not None:
                result = event.result
        return result.model_copy(update=out)

    async def exec_stream(
        self, cmd: str | list[str], *, timeout: float = 60.0, stdin: str | None = None, output_limit: int | None = None
    ) -> AsyncIterator[Event]:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            # as a sandbox's exec starts: an xdist worker ignores SIGINT, and its children would inherit that
            preexec_fn=_default_signals,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write((stdin or "").encode())
        proc.stdin.close()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()

        async def pump(stream: asyncio.StreamReader, name: str) -> None:
            while data := await stream.read(65536):
                queue.put_nowait(Event(name, data.decode(errors="replace")))
            queue.put_nowait(None)

        pumps = [asyncio.create_task(pump(proc.stdout, "stdout")), asyncio.create_task(pump(proc.stderr, "stderr"))]
        try:
            open_streams = 2
            while open_streams:
                event = await asyncio.wait_for(queue.get(), timeout)
                if event is None:
                    open_streams -= 1
                else:
                    yield event
            code = await proc.wait()
            yield Event("result", result=ExecResult(exit_code=code if code >= 0 else 128 - code))
        finally:
            with contextlib.suppress(ProcessLookupError):
                if proc.returncode is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            for task in pumps:
                task.cancel()


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
async def shell() -> AsyncIterator[tuple[ShellSession, LocalExecs]]:
    session, sb = ShellSession(CreateBashSessionRequest()), LocalExecs()
    await session.start(sb)
    try:
        yield session, sb
    finally:
        await session.close(sb)
        assert not await asyncio.to_thread(Path(session.dir).exists)


async def run(shell: tuple[ShellSession, LocalExecs], command: str, **kw: object) -> tuple[str, int | None]:
    session, sb = shell
    obs = await session.run(sb, BashAction(command=command, **kw))  # type: ignore[arg-type]
    return obs.output, obs.exit_code


async def test_state_lives_on_between_commands(shell: tuple[ShellSession, LocalExecs], tmp_path: Path) -> None:
    assert await run(shell, f'cd {tmp_path}\nexport GREETING=hi\ngreet() {{ echo "$GREETING $1"; }}') == ("", 0)
    assert await run(shell, "greet you; pwd") == (f"hi you\n{tmp_path}\n", 0)
    assert await run(shell, "printf 'no newline'") == ("no newline", 0)
    assert await run(shell, "cat <<'EOF'\n$NOT_EXPANDED\nEOF") == ("$NOT_EXPANDED\n", 0)
    assert await run(shell, "echo out; echo err >&2; (exit 3)", check="silent") == ("out\nerr\n", 3)


async def test_check_modes_and_syntax(shell: tuple[ShellSession, LocalExecs]) -> None:
    with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
        await run(shell, "false")
    with pytest.raises(NonZeroExitCodeError, match=r"^why: "):
        await run(shell, "false", error_msg="why")
    assert await run(shell, "false", check="ignore") == ("", None)
    with pytest.raises(BashIncorrectSyntaxError) as e:
        await run(shell, "echo (")
    assert "syntax error" in e.value.extra_info["bash_stderr"]
    assert await run(shell, "echo still here") == ("still here\n", 0)


async def test_expect_and_the_exit_status_after_it(shell: tuple[ShellSession, LocalExecs]) -> None:
    session, sb = shell
    obs = await session.run(sb, BashAction(command="echo ready; sleep 0.2; echo done", expect=["rea+dy"]))
    # as SWE-ReX's shell: the matched text is left out, and the exit status waited for a moment
    assert (obs.output, obs.exit_code, obs.expect_string) == ("\ndone\n", 0, "rea+dy")
    with pytest.raises(NoExitCodeError):
        await session.run(sb, BashAction(command="echo ready; sleep 3", expect=["ready"]))
    await session.interrupt(sb, BashInterruptAction())
    obs = await session.run(sb, BashAction(command="echo ready; sleep 3", expect=["ready"], check="silent"))
    assert obs.exit_code is None
    await session.interrupt(sb, BashInterruptAction())


async def test_a_timeout_leaves_the_command_running_and_an_interrupt_stops_it(
    shell: tuple[ShellSession, LocalExecs],
) -> None:
    session, sb = shell
    with pytest.raises(CommandTimeoutError):
        await run(shell, "echo started; sleep 100; echo never", timeout=0.5)
    obs = await session.interrupt(sb, BashInterruptAction())
    # what the timed-out command printed is read with the interrupt, as pexpect's buffer keeps it
    assert obs.output == "started" and obs.exit_code == 0
    assert await run(shell, "echo $?", check="silent") == ("130\n", 0)
    assert await run(shell, "echo fine") == ("fine\n", 0)


async def test_an_interrupt_stops_a_loop_of_the_shell_itself_and_spares_background_jobs(
    shell: tuple[ShellSession, LocalExecs],
) -> None:
    session, sb = shell
    await run(shell, "sleep 100 & echo $! > bg.pid", check="silent")
    with pytest.raises(CommandTimeoutError):
        await run(shell, "while true; do :; done", timeout=0.3)
    await session.interrupt(sb, BashInterruptAction())
    assert await run(shell, "kill -0 $(cat bg.pid) && echo alive; kill $(cat bg.pid); rm bg.pid") == ("alive\n", 0)


async def test_what_survives_sigint_is_killed(shell: tuple[ShellSession, LocalExecs]) -> None:
    session, sb = shell
    stubborn = "trap 'echo caught' INT; while :; do sleep 0.05; done"
    with pytest.raises(CommandTimeoutError):
        await run(shell, f"bash -c {stubborn!r}", timeout=0.5)
    obs = await session.interrupt(sb, BashInterruptAction(timeout=0.2, n_retry=2))
    assert "caught" in obs.output
    assert await run(shell, "echo usable") == ("usable\n", 0)


async def test_interactive_programs_take_their_lines(shell: tuple[ShellSession, LocalExecs]) -> None:
    session, sb = shell
    interactive = {"is_interactive_command": True, "timeout": 10}
    obs = await session.run(sb, BashAction(command="python3 -i -q", expect=[">>> "], **interactive))  # type: ignore[arg-type]
    assert obs.expect_string == ">>> "
    obs = await session.run(sb, BashAction(command="x = 6\nprint(x * 7)", expect=[">>> 42"], **interactive))  # type: ignore[arg-type]
    assert "42" in obs.output or obs.expect_string == ">>> 42"
    obs = await session.run(sb, BashAction(command="exit()", is_interactive_quit=True, timeout=10))
    assert obs.expect_string == session.prompt.ps1
    assert await run(shell, "echo back") == ("back\n", 0)


async def test_a_shell_that_exits_says_so(shell: tuple[ShellSession, LocalExecs]) -> None:
    with pytest.raises(SessionNotInitializedError, match="exited"):
        await run(shell, "echo bye; exit 3")
    with pytest.raises(SessionNotInitializedError, match="has exited"):
        await run(shell, "echo again")


async def test_startup_files_are_sourced_and_cannot_eat_input(tmp_path: Path) -> None:
    rc = tmp_path / "rc.sh"
    rc.write_text("export FROM_RC=yes\nread -r swallowed || true\necho rc done\n")
    session, sb = ShellSession(CreateBashSessionRequest(startup_source=[str(rc)])), LocalExecs()
    response = await session.start(sb)
    try:
        assert response.output == "rc done\n"
        assert (await session.run(sb, BashAction(command="echo $FROM_RC"))).output == "yes\n"
    finally:
        await session.close(sb)


async def test_large_output_is_followed_across_chunks(shell: tuple[ShellSession, LocalExecs]) -> None:
    output, code = await run(shell, "head -c 6000000 /dev/zero | tr '\\0' x; echo", timeout=60)
    assert code == 0 and len(output) == 6000001 and set(output[:-1]) == {"x"}
    assert await run(shell, "echo after") == ("after\n", 0)
