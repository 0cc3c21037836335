"""dsec/e2b-base:1, the built-in image shaped like E2B's ``base`` template, through the unmodified ``e2b``
SDK: the account ``user`` and its home by default, E2B's tools, and dsec's ``sudo`` (root only: sandboxes
run with no_new_privs, docs/e2b.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .conftest import Daemon

pytest.importorskip("e2b")
from e2b import Sandbox
from e2b.sandbox.commands.command_handle import CommandExitException

IMAGE = "dsec/e2b-base:1"


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str], daemon: Daemon) -> Iterator[Sandbox]:
    assert daemon.client().build_image(IMAGE).ready  # built first: the SDK's request timeout is 60 s
    box = Sandbox.create(IMAGE, timeout=600)
    yield box
    box.kill()


def test_the_default_account_is_user_in_its_home_with_e2bs_tools(sbx: Sandbox) -> None:
    assert sbx.commands.run("id -un; pwd; echo $HOME").stdout == "user\n/home/user\n/home/user\n"
    assert sbx.commands.run("id -un", user="user").stdout == "user\n"
    tools = "bash python3 python git curl ps pgrep sudo"
    assert sbx.commands.run(f"for t in {tools}; do command -v $t >/dev/null || echo missing $t; done").stdout == ""
    written = sbx.files.write("notes.txt", "mine")  # relative paths are the home's, as on E2B
    assert written.path == "/home/user/notes.txt"
    assert sbx.commands.run("stat -c %U:%G ~/notes.txt; cat notes.txt").stdout == "user:user\nmine"
    assert sbx.commands.run("id -un; pwd", user="root").stdout == "root\n/root\n"


def test_sudo_runs_for_root_and_refuses_the_user_saying_why(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as refused:
        sbx.commands.run("sudo id -un")
    assert refused.value.exit_code == 1 and refused.value.stdout == ""
    assert "no_new_privs" in refused.value.stderr and 'user="root"' in refused.value.stderr
    # the way to root that exists: the API's account; there sudo (and sudo -u) behave as on E2B
    assert sbx.commands.run("sudo id -un; sudo -n -E -H id -un", user="root").stdout == "root\nroot\n"
    assert sbx.commands.run("sudo -u user id -un; sudo -uuser id -Gn", user="root").stdout == "user\nuser\n"
    assert sbx.commands.run("sudo -- sh -c 'echo $0' x", user="root").stdout == "x\n"
    with pytest.raises(CommandExitException) as unknown:
        sbx.commands.run("sudo --askpass true", user="root")
    assert "does not take the option --askpass" in unknown.value.stderr
