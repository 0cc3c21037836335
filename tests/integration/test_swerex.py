"""SWE-ReX 1.4.0 on dsec (dsec.integrations.swerex), unmodified SWE-ReX against a live daemon: the
deployment's lifecycle as SWE-ReX's own deployments keep it, a session-based task as an agent drives
one (state that persists, a multi-step edit, a failing then passing check, expect, a timeout and an
interrupt that leave the session usable), one-off commands, files and uploads, and every call in an
event loop of its own, as SWE-agent makes them."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from swerex.deployment.hooks.status import SetStatusDeploymentHook
from swerex.exceptions import (
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SessionNotInitializedError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

import dsec
from dsec.integrations.swerex import DsecDeployment, DsecDeploymentConfig, DsecRuntime

from .conftest import Daemon

IMAGE = "dsec/debian:12"
pytestmark = pytest.mark.timeout(180)


def config(daemon: Daemon, **kw: object) -> DsecDeploymentConfig:
    args: dict[str, object] = {"image": IMAGE, "url": daemon.url, "token": daemon.token, "timeout": 600, **kw}
    return DsecDeploymentConfig(**args)  # type: ignore[arg-type]


@pytest.fixture
async def deployment(daemon: Daemon) -> AsyncIterator[DsecDeployment]:
    d = config(daemon).get_deployment()
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


def runner(rt: DsecRuntime, session: str = "default"):  # type: ignore[no-untyped-def]
    async def run(command: str, **kw: object) -> BashObservation:
        return await rt.run_in_session(BashAction(command=command, session=session, **kw))  # type: ignore[arg-type]

    return run


async def test_the_deployment_lifecycle_is_swe_rexs(daemon: Daemon) -> None:
    steps: list[str] = []
    d = config(daemon, labels={"test": "swerex-lifecycle"}).get_deployment()
    d.add_hook(SetStatusDeploymentHook("d1", lambda _id, message: steps.append(message)))
    # before start: not alive, and no runtime
    assert not await d.is_alive()
    with pytest.raises(DeploymentNotStartedError):
        d.runtime  # noqa: B018
    await d.start()
    runtime = d.runtime
    sandbox_id = d.sandbox_id
    assert sandbox_id is not None and steps == ["Starting dsec sandbox"]
    try:
        assert await d.is_alive(timeout=10)
        async with dsec.AsyncClient(daemon.url, daemon.token) as client:
            listed = await client.list(labels={"test": "swerex-lifecycle", "dsec.integration": "swe-rex"})
        assert [s.id for s in listed] == [sandbox_id]
        response = await runtime.execute(Command(command="echo hi", shell=True))
        assert (response.stdout, response.exit_code) == ("hi\n", 0)
        with pytest.raises(RuntimeError, match="already runs"):
            await d.start()
    finally:
        await d.stop()
    # after stop: not alive, no runtime, and the sandbox is gone from the node
    assert not await d.is_alive()
    with pytest.raises(DeploymentNotStartedError):
        d.runtime  # noqa: B018
    alive = await runtime.is_alive(timeout=10)
    assert not alive and "stopped" in alive.message
    async with dsec.AsyncClient(daemon.url, daemon.token) as client:
        assert sandbox_id not in [s.id for s in await client.list()]
        assert (await (await dsec.AsyncSandbox.connect(sandbox_id, client=client)).info()).state == "stopped"
    await d.stop()  # stopping again does nothing


async def test_a_start_that_cannot_create_its_sandbox_says_why(daemon: Daemon) -> None:
    from swerex.exceptions import DeploymentStartupError

    d = config(daemon, image="dsec/no-such-image:1").get_deployment()
    with pytest.raises(DeploymentStartupError, match="no-such-image"):
        await d.start()
    assert not await d.is_alive()


async def test_a_session_based_task(deployment: DsecDeployment) -> None:
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"]))
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())
    run = runner(rt)
    # cd and export persist between actions
    # (the export also keeps Python from caching calc.py's bytecode: the fix below keeps its size, and a
    # cached copy from the same second would hide it)
    await run("mkdir -p /work/repo && cd /work/repo && export PYTHONDONTWRITEBYTECODE=1")
    assert (await run("pwd; echo $PYTHONDONTWRITEBYTECODE")).output == "/work/repo\n1\n"
    # a multi-step edit: write a module with a bug and its check, see the check fail, fix it, see it pass
    await run("cat > calc.py <<'EOF'\ndef add(a, b):\n    return a - b\nEOF")
    await run("cat > check.py <<'EOF'\nfrom calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\nEOF")
    failing = await run("python3 check.py", check="silent")
    assert failing.exit_code == 1 and "AssertionError: -1" in failing.output
    with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
        await run("python3 check.py")
    await run("sed -i 's/a - b/a + b/' calc.py")
    assert (await run("grep return calc.py")).output == "    return a + b\n"
    passing = await run("python3 check.py")
    assert (passing.output, passing.exit_code) == ("ok\n", 0)
    # expect: a prompt the command prints before it waits for input, then the input it waits for
    asked = await run("echo 'Proceed? [y/n]'; read answer; echo \"got $answer\"", expect=[r"\[y/n\]"], check="ignore")
    assert asked.expect_string == r"\[y/n\]" and asked.output == "Proceed? "
    answered = await rt.run_in_session(BashAction(command="y", is_interactive_command=True, timeout=30))
    assert answered.output == "got y"
    # a timeout raises SWE-ReX's error; the command goes on until interrupted; the session stays usable
    with pytest.raises(CommandTimeoutError, match=r"timeout after 1\.0 seconds"):
        await run("sleep 100", timeout=1.0)
    # (looked at from outside the session, whose shell is busy until then)
    sleeping = Command(command="cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -cx '10[0]'", shell=True)
    assert (await rt.execute(sleeping)).stdout == "1\n"
    interrupted = await rt.run_in_session(BashInterruptAction())
    assert interrupted.exit_code == 0
    assert (await rt.execute(sleeping)).stdout == "0\n"
    after = await run("echo $?; pwd; echo $PYTHONDONTWRITEBYTECODE; ls", check="silent")
    assert after.output == "130\n/work/repo\n1\ncalc.py\ncheck.py\n"
    # closing the session ends its shell
    await rt.close_session(CloseBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await run("pwd")
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest())
    shells = await rt.execute(Command(command="cat /proc/[0-9]*/comm | grep -cx bash", shell=True))
    assert shells.stdout == "0\n"


async def test_sessions_are_independent(deployment: DsecDeployment) -> None:
    rt = deployment.runtime
    for name in ("a", "b"):
        await rt.create_session(CreateBashSessionRequest(session=name))
    await runner(rt, "a")("cd /tmp; X=from-a")
    b = await runner(rt, "b")("pwd; echo ${X:-unset}")
    assert b.output == "/\nunset\n"
    with pytest.raises(CommandTimeoutError):
        await runner(rt, "a")("sleep 100", timeout=0.5)
    assert (await runner(rt, "b")("echo b is free")).output == "b is free\n"
    await rt.run_in_session(BashInterruptAction(session="a"))
    assert (await runner(rt, "a")("echo $X")).output == "from-a\n"


async def test_a_shell_that_exits_is_reported(deployment: DsecDeployment) -> None:
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    with pytest.raises(SessionNotInitializedError, match="exited"):
        await runner(rt)("exit 4")


async def test_an_image_without_bash_is_a_clear_error(daemon: Daemon) -> None:
    d = config(daemon, image="dsec/busybox").get_deployment()
    await d.start()
    try:
        with pytest.raises(SessionNotInitializedError, match="needs bash"):
            await d.runtime.create_session(CreateBashSessionRequest())
        response = await d.runtime.execute(Command(command="echo still fine", shell=True))
        assert response.stdout == "still fine\n"
    finally:
        await d.stop()


async def test_execute_as_subprocess_run(deployment: DsecDeployment) -> None:
    rt = deployment.runtime
    assert (await rt.execute(Command(command=["pwd"], cwd="/tmp"))).stdout == "/tmp\n"
    # env replaces the environment (HOME is gone), as subprocess's env does
    env = await rt.execute(Command(command="echo $FOO-${HOME:-nohome}", shell=True, env={"FOO": "bar"}))
    assert env.stdout == "bar-nohome\n"
    both = await rt.execute(Command(command="echo out; echo err >&2; exit 3", shell=True))
    assert (both.stdout, both.stderr, both.exit_code) == ("out\n", "err\n", 3)
    merged = await rt.execute(Command(command="echo a; echo b >&2; echo c", shell=True, merge_output_streams=True))
    assert (merged.stdout, merged.stderr) == ("a\nb\nc\n", "")
    killed = await rt.execute(Command(command=["sh", "-c", "kill -9 $$"]))
    assert killed.exit_code == -9
    with pytest.raises(NonZeroExitCodeError, match=r"^oops: Command 'exit 3' failed with exit code 3\."):
        await rt.execute(Command(command="exit 3", shell=True, check=True, error_msg="oops"))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "30"], timeout=0.5))
    with pytest.raises(FileNotFoundError):
        await rt.execute(Command(command="no-such-program --flag"))
    with pytest.raises(FileNotFoundError):
        await rt.execute(Command(command=["pwd"], cwd="/no/such/dir"))


async def test_files_and_uploads(deployment: DsecDeployment, tmp_path: Path) -> None:
    rt = deployment.runtime
    # write_file makes the missing parents; read_file reads it back
    await rt.write_file(WriteFileRequest(path="/work/new/deep/notes.txt", content="héllo\nwörld\n"))
    assert (await rt.read_file(ReadFileRequest(path="/work/new/deep/notes.txt"))).content == "héllo\nwörld\n"
    await rt.write_file(WriteFileRequest(path="/work/new/deep/notes.txt", content="short\n"))
    assert (await rt.execute(Command(command=["cat", "/work/new/deep/notes.txt"]))).stdout == "short\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/work/none.txt"))
    # a file, with its mode, to a path and into a directory
    tool = tmp_path / "tool.sh"
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    await rt.upload(UploadRequest(source_path=str(tool), target_path="/work/bin/run-tool"))
    assert (await rt.execute(Command(command=["/work/bin/run-tool"]))).stdout == "tool ran\n"
    await rt.upload(UploadRequest(source_path=str(tool), target_path="/work/bin"))
    assert (await rt.execute(Command(command=["/work/bin/tool.sh"]))).stdout == "tool ran\n"
    # a directory: its contents merged into the target
    tree = tmp_path / "pkg"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a\n")
    (tree / "sub" / "b.txt").write_text("b\n")
    (tree / "sub" / "run.sh").write_text("#!/bin/sh\necho nested\n")
    (tree / "sub" / "run.sh").chmod(0o755)
    await rt.upload(UploadRequest(source_path=str(tree), target_path="/work/pkg"))
    listing = await rt.execute(Command(command="cd /work/pkg && find . -type f | sort && sub/run.sh", shell=True))
    assert listing.stdout == "./a.txt\n./sub/b.txt\n./sub/run.sh\nnested\n"
    assert (await rt.read_file(ReadFileRequest(path="/work/pkg/sub/b.txt"))).content == "b\n"
    with pytest.raises(FileNotFoundError):
        await rt.upload(UploadRequest(source_path=str(tmp_path / "missing"), target_path="/work/x"))
    # what the file calls wrote, a session sees
    await rt.create_session(CreateBashSessionRequest())
    assert (await runner(rt)("cat /work/pkg/a.txt /work/new/deep/notes.txt")).output == "a\nshort\n"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755


def test_every_call_in_an_event_loop_of_its_own(daemon: Daemon) -> None:
    """SWE-agent wraps each call in asyncio.run: nothing may outlive a loop (a connection would leak a
    descriptor per call)."""
    d = config(daemon).get_deployment()
    asyncio.run(d.start())
    try:
        rt = d.runtime
        asyncio.run(rt.create_session(CreateBashSessionRequest()))
        asyncio.run(rt.run_in_session(BashAction(command="export STEP=0")))
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(1, 21):
            obs = asyncio.run(rt.run_in_session(BashAction(command="STEP=$((STEP + 1)); echo $STEP")))
            assert obs.output == f"{i}\n"
        assert len(os.listdir("/proc/self/fd")) <= fds + 2
        with pytest.raises(CommandTimeoutError):
            asyncio.run(rt.run_in_session(BashAction(command="sleep 100", timeout=0.5)))
        asyncio.run(rt.run_in_session(BashInterruptAction()))
        assert asyncio.run(rt.run_in_session(BashAction(command="echo $STEP"))).output == "20\n"
        assert asyncio.run(d.is_alive(timeout=10))
    finally:
        asyncio.run(d.stop())
