"""E2B's ``sbx.pty`` on every kind, with the unmodified ``e2b`` SDK against a live daemon: the shell the
SDK starts runs on a real pseudo-terminal made inside the sandbox (its controlling terminal, the
sandbox's /dev/pts), typed input is echoed, ^C interrupts, a resize is seen by the program (SIGWINCH,
``stty size``), a kill ends it, and a reconnect sees what follows. Also: a command's stream when its
sandbox is killed (issue 24, bug 7). The VM kinds boot real QEMU guests (TCG here): one sandbox each."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

import dsec

from .conftest import Daemon, require_kind, resolves, systemd_spec

e2b = pytest.importorskip("e2b")
from e2b import CommandHandle, PtySize, Sandbox  # noqa: E402
from e2b.exceptions import SandboxNotRunningException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

# the vm kind boots the image's own init: systemd (udev, or units bound to devices wait 90 s)
WAYS: dict[str, dict[str, Any]] = {
    "container": {"template": "dsec/debian:12"},
    "function": {"metadata": {"dsec.kind": "function"}},
    "microvm": {"template": "dsec/debian:12@microvm", "metadata": {"dsec.memory": "384Mi"}},
    "vm": {"metadata": {"dsec.kind": "vm", "dsec.memory": "512Mi"}},
}


class Screen:
    """What a terminal shows, read from its handle as it comes."""

    def __init__(self, handle: CommandHandle) -> None:
        self.events = iter(handle)
        self.text = ""

    def until(self, marker: str) -> str:
        """Everything shown up to ``marker`` (from where the last call stopped)."""
        while marker not in self.text:
            _, _, pty = next(self.events)
            if pty:
                self.text += pty.decode(errors="replace")
        shown, _, self.text = self.text.partition(marker)
        return shown + marker


@pytest.fixture
def box(kind: str, daemon: Daemon, e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    client = daemon.client()
    require_kind(client, kind)
    way = dict(WAYS[kind])
    if kind == "vm":
        if not resolves("deb.debian.org"):
            pytest.skip("no route to the Debian archive to build a systemd image for the vm kind")
        way["template"] = client.build(systemd_spec(), f"test/systemd-vm:{secrets.token_hex(4)}").image.name  # cached
    sandbox = Sandbox.create(timeout=900, request_timeout=600, **way)
    assert dsec.Sandbox.connect(sandbox.sandbox_id, client=client).info().kind == kind
    try:
        yield sandbox
    finally:
        sandbox.kill()


@pytest.mark.parametrize("kind", list(WAYS))
def test_a_terminal_in_every_kind(kind: str, box: Sandbox) -> None:
    term = box.pty.create(PtySize(rows=24, cols=80), envs={"GREETING": "hi there"}, timeout=600)
    screen = Screen(term)
    # mark-$((..)): what the shell prints differs from the typed line the terminal echoes
    box.pty.send_stdin(
        term.pid, b'tty; stty size; echo "$TERM/$GREETING"; trap "echo winched" WINCH; echo mark-$((40+2))\n'
    )
    shown = screen.until("mark-42")
    assert 'echo "$TERM/$GREETING"' in shown  # the line discipline echoed what was typed
    assert re.search(r"\r/dev/pts/\d+\r\n24 80\r\nxterm-256color/hi there\r\nmark-42$", shown), shown

    box.pty.resize(term.pid, PtySize(rows=30, cols=100))
    box.pty.send_stdin(term.pid, b"stty size; tput cols; echo mark-$((50+5))\n")
    shown = screen.until("mark-55")
    assert "winched" in shown and "30 100\r\n100\r\nmark-55" in shown, shown

    box.pty.send_stdin(term.pid, b"sleep 300; echo mark-$((7*7))\n")
    screen.until("sleep 300; echo mark-$((7*7))\r\n")
    time.sleep(0.5)
    started = time.monotonic()
    box.pty.send_stdin(term.pid, b"\x03")  # ^C: SIGINT to the foreground job, the shell lives on
    box.pty.send_stdin(term.pid, b"echo mark-$((60+6))\n")
    shown = screen.until("mark-66")
    assert time.monotonic() - started < 30 and "mark-49" not in shown

    assert box.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException) as killed:
        term.wait()
    assert killed.value.exit_code == -1
    with pytest.raises(CommandExitException):
        box.commands.run(f"kill -0 {term.pid}")  # no such process any more
    assert box.pty.kill(term.pid) is False


@pytest.mark.parametrize("kind", ["container"])
def test_a_terminal_outlives_its_stream_and_exits_with_its_shell(kind: str, box: Sandbox) -> None:
    term = box.pty.create(PtySize(rows=24, cols=80), user="nobody", cwd="/tmp", timeout=120)
    line = b'echo mark-$((3*3)); read -r line; echo "$(id -un) in $(pwd) owns $(stat -c %U $(tty)): $line"\n'
    box.pty.send_stdin(term.pid, line)
    term.disconnect()
    again = box.pty.connect(term.pid, timeout=120)
    # typed once the shell runs the line: what is typed ahead while it edits a line is one line to `read`
    Screen(again).until("mark-9")
    box.pty.send_stdin(term.pid, b"typed after the reconnect\n")
    box.pty.send_stdin(term.pid, b"exit 7\n")
    shown: list[bytes] = []
    with pytest.raises(CommandExitException) as ended:
        again.wait(on_pty=shown.append)
    assert ended.value.exit_code == 7
    # the terminal's slave belongs to the account the shell runs as
    assert "nobody in /tmp owns nobody: typed after the reconnect" in b"".join(shown).decode()


@pytest.mark.parametrize("kind", ["container", "microvm"])
def test_killing_the_sandbox_under_a_running_command_says_so(kind: str, box: Sandbox) -> None:
    sleeper = box.commands.run("sleep 300", background=True)
    term = box.pty.create(PtySize(rows=24, cols=80), timeout=600)
    box.kill()
    for handle in (sleeper, term):
        started = time.monotonic()
        with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
            handle.wait()
        assert time.monotonic() - started < 30
