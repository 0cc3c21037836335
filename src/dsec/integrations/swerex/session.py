"""A persistent bash session inside a dsec sandbox, driven through dsec's public SDK.

dsec's SDK runs a command and returns (or streams) its result; it cannot write to the standard input of
a command that is still running. A SWE-ReX session needs one shell whose state (``cd``, exported
variables, functions, background jobs) lives on between actions. So the shell is started detached and
outlives the exec that started it (dsec leaves a finished exec's background processes alone; only a
timed-out exec has its process tree killed), and each action is one short exec of a small driver script
(``driver.sh``, installed in the session's directory under /tmp) that talks to it:

- The shell is ``bash --noediting --norc -i``: interactive, so that SIGINT abandons the command line it
  is running and gets back to its prompt, as in a terminal. Its standard input is a FIFO; its stdout and
  stderr append to a log file. It runs in a process group of its own.
- A command is written to a file, checked with ``bash -n`` (SWE-ReX's ``BashIncorrectSyntaxError``), and
  the driver writes one line to the FIFO: ``__dsec_tok=TOKEN; source FILE``. ``source`` runs the command
  in the shell itself, however many lines, heredocs included, so its state persists.
- PS1 is ``__dsec_ps1_<nonce>_${__dsec_tok}_$?__``: the prompt after a command names it and carries its
  exit status. The driver then follows the log (``tail -f``) from where this client last read it and
  streams it back through ``exec_stream``; this client matches the command's own prompt, or any of the
  action's ``expect`` patterns (regular expressions, searched as pexpect searches), and closes the
  stream, which ends the driver's exec. Output nobody consumed (a timed-out command's, a background
  job's) stays in the log for the next action, as pexpect's buffer keeps it.
- An interrupt is ``kill -INT`` to the shell's process group: the foreground command and the shell get
  it, as a terminal's ^C gives it to them; background jobs ignore SIGINT in a shell without job control
  and keep running. It is sent up to ``n_retry`` times; then whatever still runs in the foreground (in
  the group and not ignoring SIGINT) is killed with SIGKILL, and SIGINT sent once more.
- Interactive programs (``is_interactive_command``) get their lines through the same FIFO.

Against SWE-ReX's local shell (bash under pexpect on a pseudo-terminal), the differences are those of
having no terminal: programs see none (``isatty`` is false: no pagers, no colours, ``python3`` needs
``-i`` to be interactive), there is no job control (``fg``, ^Z), and bash reads its input in blocks, so
a multi-line interactive input is handed over one line every 50 ms rather than all at once. A program
that survives SIGINT and has to be killed does not stop the rest of its command line (a terminal's ^Z
in SWE-ReX's fallback would). Output carries no terminal echo or stray carriage returns.

Every call of the runtime may run on an event loop of its own (SWE-agent wraps each in ``asyncio.run``),
so a session keeps no connection or task between calls: only its directory, its nonce and how far it
has read the log.
"""

from __future__ import annotations

import re
import secrets
from importlib import resources
from typing import NoReturn

from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionNotInitializedError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    BashObservation,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
)

from .follow import Execs, Follow, ShellGone, SyntaxRejected
from .output import Found, Prompt, byte_length, clean, compile_expect, first_line

# Starting a session costs an exec and a shell's start on top of what the request's startup_timeout
# (1 s by default, sized for sourcing files) allows.
START_ALLOWANCE = 10.0
# After an expect pattern matched, how long to wait for the command's own prompt to learn its exit
# status (SWE-ReX's local shell waits 1 s for the same).
EXIT_STATUS_WAIT = 1.0
# An interrupt's attempts each wait at least this long (SWE-ReX's 0.2 s default is a terminal's round trip,
# and this one is a signal through an exec)
INTERRUPT_WAIT = 1.0
# What a shell prints right after an interrupt (a newline, another prompt) is read along with it
INTERRUPT_DRAIN = 0.2
INSTALL = 'mkdir -p "$1" && cat >"$1/driver" && exec bash "$1/driver" "$1" start "$2"'


def driver_script() -> str:
    return resources.files(__package__).joinpath("driver.sh").read_text()


class ShellSession:
    """The client's side of one session: the sandbox is handed to each call (see the module's docstring)."""

    def __init__(self, request: CreateBashSessionRequest) -> None:
        self.request = request
        self.nonce = secrets.token_hex(6)
        self.dir = f"/tmp/.dsec-swerex-{self.nonce}"
        self.prompt = Prompt(self.nonce)
        self.offset = 0  # how far the log has been read: up to the end of the last match
        self.mark = "-"  # the prompt the last match ended with, when it was a command's own
        self.finished: list[str] = []  # tokens of commands whose files the next run may remove
        self.exited = False

    @property
    def _driver(self) -> list[str]:
        return ["bash", f"{self.dir}/driver", self.dir]

    async def start(self, sb: Execs) -> CreateBashSessionResponse:
        token = secrets.token_hex(4)
        line = first_line(token, self.prompt, self.request.startup_source)
        argv = ["bash", "-c", INSTALL, "dsec-swerex", self.dir, line]
        # its own exec, which ends once the shell runs: the exec that starts the shell must not be the
        # one the follow's end cancels, for the daemon kills a cancelled exec's cgroup and all in it
        started = await sb.exec(argv, stdin=driver_script(), timeout=START_ALLOWANCE)
        if started.exit_code != 0:
            raise SessionNotInitializedError(
                f"could not start a shell for session {self.request.session!r} (the image needs bash): "
                f"exit status {started.exit_code}: {(started.stdout + started.stderr).strip()[-2000:]}"
            )
        async with Follow(sb, self._driver, [*self._driver, "follow", "0"]) as f:
            found = await self._wait(f, [self.prompt.of(token)], self.request.startup_timeout + START_ALLOWANCE)
            if found is None:
                raise CommandTimeoutError(f"the shell of session {self.request.session!r} did not start in time")
            self._consumed(f, found.end, found.text)
            return CreateBashSessionResponse(output=self.prompt.strip(clean(f.output.slice(0, found.start))))

    async def run(self, sb: Execs, action: BashAction) -> BashObservation:
        self._check_alive()
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._run_raw(sb, action)
        token = secrets.token_hex(4)
        own = self.prompt.of(token)
        argv = [*self._driver, "run", str(self.offset), self.mark, token, *self.finished]
        self.finished = []  # the driver removes them first thing
        async with Follow(sb, self._driver, argv, stdin=action.command) as f:
            try:
                found = await self._wait(f, [*compile_expect(action.expect), own], action.timeout)
            except SyntaxRejected as e:
                raise _syntax_error(action.command, e) from None
            if found is None:
                await self._timed_out(f, action)
            output = f.output.slice(0, found.start)
            end, mark, exit_code = found.end, "-", None
            if found.index == len(action.expect):  # the command's own prompt
                mark, exit_code = found.text, int(found.groups[0] or 0)
            elif action.check != "ignore":  # as SWE-ReX's shell does: look for the exit status a moment longer
                after = await self._wait(f, [own], EXIT_STATUS_WAIT, found.end)
                if after is not None:
                    output += f.output.slice(found.end, after.start)
                    end, mark, exit_code = after.end, after.text, int(after.groups[0] or 0)
            if exit_code is not None:
                self.finished.append(token)
            self._consumed(f, end, mark)
        observation = BashObservation(
            output=self.prompt.strip(clean(output)),
            exit_code=None if action.check == "ignore" else exit_code,
            expect_string=self._matched(found, action.expect),
        )
        _check(action, observation)
        return observation

    async def _run_raw(self, sb: Execs, action: BashAction) -> BashObservation:
        """Lines for the program reading the shell's input (or the shell): no syntax check, no exit status."""
        argv = [*self._driver, "raw", str(self.offset), self.mark]
        async with Follow(sb, self._driver, argv, stdin=action.command) as f:
            found = await self._wait(f, [*compile_expect(action.expect), self.prompt.any], action.timeout)
            if found is None:
                await self._timed_out(f, action)
            self._consumed(f, found.end, "-")
            output = self.prompt.strip(clean(f.output.slice(0, found.start)))
        return BashObservation(
            output=output if action.is_interactive_quit else output.strip(),
            exit_code=0,
            expect_string=self._matched(found, action.expect),
        )

    async def interrupt(self, sb: Execs, action: BashInterruptAction) -> BashObservation:
        self._check_alive()
        patterns = [*compile_expect(action.expect), self.prompt.any]
        wait = max(action.timeout, INTERRUPT_WAIT)
        argv = [*self._driver, "intr", str(self.offset), self.mark]
        async with Follow(sb, self._driver, argv) as f:
            found = await self._wait(f, patterns, wait)
            for attempt in range(1, action.n_retry + 1):
                if found is not None:
                    break
                # the first SIGINT went with the call; then SIGINT again, and at last SIGKILL what outlived them
                await self.signal(sb, "KILL" if attempt == action.n_retry else "INT")
                found = await self._wait(f, patterns, wait)
            if found is None:
                await self._unread(f)
                raise CommandTimeoutError(f"Failed to interrupt session {self.request.session!r}")
            await f.drain(INTERRUPT_DRAIN)
            text = f.output.slice()
            self._consumed(f, len(text), "-")
        output = self.prompt.strip(clean(text[: found.start] + text[found.end :]))
        return BashObservation(output=output.strip(), exit_code=0, expect_string=self._matched(found, action.expect))

    async def signal(self, sb: Execs, which: str) -> None:
        await sb.exec([*self._driver, "signal", which], timeout=30)

    async def close(self, sb: Execs) -> None:
        await sb.exec([*self._driver, "close"], timeout=30)

    def _check_alive(self) -> None:
        if self.exited:
            raise SessionNotInitializedError(f"the shell of session {self.request.session!r} has exited")

    async def _wait(
        self, f: Follow, patterns: list[re.Pattern[str]], timeout: float | None, pos: int = 0
    ) -> Found | None:
        try:
            return await f.wait(patterns, timeout, pos)
        except ShellGone:
            self.exited = True
            tail = self.prompt.strip(clean(f.output.slice()))[-2000:]
            raise SessionNotInitializedError(
                f"the shell of session {self.request.session!r} exited; its last output:\n{tail}"
            ) from None

    async def _timed_out(self, f: Follow, action: BashAction) -> NoReturn:
        await self._unread(f)
        raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {action.command!r}")

    async def _unread(self, f: Follow) -> None:
        """Nothing matched: the log is to be read again from where this call began (which is where the
        driver's header put it, the log perhaps emptied first). Without a header the old place holds."""
        if await f.settled():
            self._consumed(f, 0, "-")

    def _consumed(self, f: Follow, end: int, mark: str) -> None:
        """The log has been read up to ``end`` (an offset into ``f.output``); ``mark``: the prompt it ends with."""
        self.offset = f.base + byte_length(f.output.slice(0, end))
        self.mark = mark

    def _matched(self, found: Found, expect: list[str]) -> str:
        """An observation's expect_string: the pattern that matched, or the PS1 for a prompt."""
        return expect[found.index] if found.index < len(expect) else self.prompt.ps1


def _check(action: BashAction, observation: BashObservation) -> None:
    if action.check != "raise":
        return
    if observation.exit_code is None:
        raise NoExitCodeError(
            f"no exit status for {action.command!r}: an expect pattern matched and the command went on"
        )
    if observation.exit_code != 0:
        msg = (
            f"Command {action.command!r} failed with exit code {observation.exit_code}. "
            f"Here is the output:\n{observation.output!r}"
        )
        raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)


def _syntax_error(command: str, e: SyntaxRejected) -> BashIncorrectSyntaxError:
    msg = (
        f"Error (exit code {e.rc}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{e.message}\n---- Stdout ----\n"
    )
    return BashIncorrectSyntaxError(msg, extra_info={"bash_stdout": "", "bash_stderr": e.message})
