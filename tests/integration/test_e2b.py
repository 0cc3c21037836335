"""The unmodified ``e2b`` SDK (PyPI, pinned in pyproject.toml) against a live daemon's E2B-compatible API:
commands and files on container sandboxes. Lifecycle, errors, tenants and trajectories are in
test_e2b_lifecycle.py; the same script on other kinds in test_e2b_kinds.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, e2b_environment

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, Sandbox  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    FileNotFoundException,
    InvalidArgumentException,
    SandboxException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

SCRIPT = """
import json
from e2b import Sandbox

sbx = Sandbox.create()  # E2B's default template: dsec's default image
out = {"id": sbx.sandbox_id}
res = sbx.commands.run("echo hello from $(uname -s); echo oops >&2")
out["run"] = [res.exit_code, res.stdout, res.stderr]
try:
    sbx.commands.run("exit 7")
except Exception as e:
    out["fail"] = [type(e).__name__, e.exit_code]
sbx.files.write("/tmp/data.bin", bytes(range(256)))
out["same"] = sbx.files.read("/tmp/data.bin", format="bytes") == bytes(range(256))
out["listed"] = [e.name for e in sbx.files.list("/tmp")]
out["killed"] = sbx.kill()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    box = Sandbox.create(timeout=900)
    yield box
    box.kill()


def test_an_unmodified_e2b_script_runs_by_setting_only_environment_variables(
    e2b_env: dict[str, str], daemon: Daemon, tmp_path: Path
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_", "E2B_"))} | e2b_env
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["run"] == [0, "hello from Linux\n", "oops\n"]
    assert out["fail"] == ["CommandExitException", 7]
    assert out["same"] is True and "data.bin" in out["listed"] and out["killed"] is True
    gone = dsec.Sandbox.connect(out["id"], client=daemon.client()).info()
    assert gone.state.value == "stopped"  # a real dsec sandbox, now gone


def test_exit_codes_output_cwd_env_and_users(sbx: Sandbox) -> None:
    res = sbx.commands.run("echo out; echo err >&2")
    assert (res.exit_code, res.stdout, res.stderr) == (0, "out\n", "err\n")
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    with pytest.raises(CommandExitException) as missing:
        sbx.commands.run("no-such-command-here")
    assert missing.value.exit_code == 127 and "not found" in missing.value.stderr
    assert sbx.commands.run("pwd; echo $A-$B", cwd="/tmp", envs={"A": "1", "B": "two"}).stdout == "/tmp\n1-two\n"
    assert sbx.commands.run("pwd").stdout == "/root\n"  # the default account's home, as E2B starts in ~
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    # a system account whose home does not exist starts in /
    assert sbx.commands.run("id -un; pwd", user="nobody").stdout == "nobody\n/\n"
    with pytest.raises(InvalidArgumentException, match="ghost"):
        sbx.commands.run("true", user="ghost")


def test_a_timeout_kills_the_whole_command(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 60 & echo $! > /tmp/orphan.pid; sleep 60", timeout=2)
    assert time.monotonic() - started < 15
    time.sleep(0.5)
    # the command's tree went with it: its daemonised child is not running any more
    assert sbx.commands.run("kill -0 $(cat /tmp/orphan.pid) 2>/dev/null && echo alive || echo gone").stdout == "gone\n"
    assert sbx.commands.list() == []


def test_output_streams_while_the_command_runs_and_a_flood_is_bounded(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    res = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done", on_stdout=lambda d: seen.append((time.monotonic(), d))
    )
    done = time.monotonic()
    assert "".join(d for _, d in seen) == res.stdout == "line1\nline2\nline3\n"
    assert done - seen[0][0] > 0.8  # the first line came a second before the end, not with it
    flood = sbx.commands.run("head -c 60000000 /dev/zero | tr '\\0' x", timeout=120)
    assert 16 << 20 <= len(flood.stdout) < (16 << 20) + 200 and "is not streamed" in flood.stdout
    assert sbx.commands.run("echo still here").stdout == "still here\n"


def test_background_commands_list_reconnect_and_kill(sbx: Sandbox) -> None:
    sleeper = sbx.commands.run("sleep 120", background=True)
    counter = sbx.commands.run("for i in 1 2 3 4 5; do echo n$i; sleep 0.4; done", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert listed[sleeper.pid].cmd == "/bin/bash" and listed[sleeper.pid].args[-1] == "sleep 120"
    counter.disconnect()  # the command goes on without a stream
    again = sbx.commands.connect(counter.pid)
    assert again.wait().stdout.endswith("n5\n")
    assert sleeper.kill() is True
    with pytest.raises(CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code == -1 and killed.value.exit_code != 0
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(sleeper.pid) is False  # no such process any more


def test_stdin_is_fed_while_the_command_runs(sbx: Sandbox, e2b_env: dict[str, str]) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "first ")
    sbx.commands.send_stdin(cat.pid, b"second\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "first second\n"
    plain = sbx.commands.run("sleep 30", background=True)  # started without stdin
    with pytest.raises(SandboxException, match="standard input"):
        sbx.commands.send_stdin(plain.pid, "x")
    plain.kill()

    async def streamed() -> str:
        box = await AsyncSandbox.connect(sbx.sandbox_id)
        handle = await box.commands.run("wc -c", background=True, stdin=True)
        stream = box.commands.stream_input(handle.pid)
        for _ in range(10):
            await stream.send(b"0123456789")
        await stream.close()
        await box.commands.close_stdin(handle.pid)
        return (await handle.wait()).stdout

    assert asyncio.run(streamed()).strip() == "100"


def test_files_round_trip_binary_data_and_paths(sbx: Sandbox) -> None:
    blob = os.urandom(3 << 20) + bytes(range(256))
    sbx.files.write("/tmp/f/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/f/blob.bin", format="bytes")) == blob
    assert sbx.files.read("/tmp/f/blob.bin", format="stream") is not None
    infos = sbx.files.write_files([{"path": "/tmp/f/a.txt", "data": "A"}, {"path": "/tmp/f/b.bin", "data": b"\0\xff"}])
    assert [i.path for i in infos] == ["/tmp/f/a.txt", "/tmp/f/b.bin"]
    sbx.files.write("/tmp/f/z.txt", "zz" * 5000, gzip=True)
    assert sbx.files.read("/tmp/f/z.txt", gzip=True) == "zz" * 5000
    sbx.files.write("relative.txt", "home")  # relative paths are the account's home's, as in E2B
    assert sbx.commands.run("cat /root/relative.txt").stdout == "home"
    assert sbx.files.exists("/tmp/f/a.txt") and not sbx.files.exists("/tmp/f/nope")
    info = sbx.files.get_info("/tmp/f/blob.bin")
    assert (info.name, info.type.value, info.size, info.permissions) == ("blob.bin", "file", len(blob), "-rw-r--r--")
    assert sbx.files.make_dir("/tmp/f/d/e") is True and sbx.files.make_dir("/tmp/f/d/e") is False
    moved = sbx.files.rename("/tmp/f/a.txt", "/tmp/f/d/e/a2.txt")
    assert moved.path == "/tmp/f/d/e/a2.txt" and sbx.files.read("/tmp/f/d/e/a2.txt") == "A"
    assert {e.path for e in sbx.files.list("/tmp/f", depth=3)} >= {"/tmp/f/d", "/tmp/f/d/e", "/tmp/f/d/e/a2.txt"}
    assert "d" in {e.name for e in sbx.files.list("/tmp/f")} and "e" not in {e.name for e in sbx.files.list("/tmp/f")}
    sbx.files.remove("/tmp/f/d")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/f/d/e/a2.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info("/tmp/f/d")
    assert sbx.files.write("/tmp/f/m.txt", "m", metadata={"k": "v"}).metadata == {"k": "v"}  # test_e2b_files.py
    with pytest.raises(SandboxException):
        sbx.files.read("/tmp/f")  # a directory
    # what a command writes is what the API reads, and the other way round
    sbx.commands.run("printf '\\x00\\x01from-cmd' > /tmp/f/c.bin")
    assert bytes(sbx.files.read("/tmp/f/c.bin", format="bytes")) == b"\x00\x01from-cmd"


def test_watching_a_directory(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/w")
    handle = sbx.files.watch_dir("/tmp/w", recursive=True)
    sbx.files.write("/tmp/w/new.txt", "1")
    sbx.commands.run("mkdir -p /tmp/w/sub && echo 2 > /tmp/w/sub/deep.txt")
    time.sleep(0.3)
    events = {(e.name, e.type.value) for e in handle.get_new_events()}
    assert {("new.txt", "create"), ("sub", "create"), ("sub/deep.txt", "create")} <= events
    sbx.files.remove("/tmp/w/new.txt")
    assert ("new.txt", "remove") in {(e.name, e.type.value) for e in handle.get_new_events()}
    handle.stop()

    async def streamed() -> list[tuple[str, str]]:
        box = await AsyncSandbox.connect(sbx.sandbox_id)
        seen: list[tuple[str, str]] = []
        watch = await box.files.watch_dir("/tmp/w", on_event=lambda e: seen.append((e.name, e.type.value)))
        await box.files.write("/tmp/w/async.txt", "a")
        for _ in range(40):
            if seen:
                break
            await asyncio.sleep(0.1)
        await watch.stop()
        return seen

    assert ("async.txt", "create") in asyncio.run(streamed())
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir("/tmp/no-such-dir")


def test_the_runtime_exec_path_drives_commands_live_too(runtime_daemon: Daemon) -> None:
    env = e2b_environment(runtime_daemon)
    box = Sandbox.create(api_key=env["E2B_API_KEY"], api_url=env["E2B_API_URL"], sandbox_url=env["E2B_SANDBOX_URL"])
    try:
        cat = box.commands.run("cat", background=True, stdin=True)
        box.commands.send_stdin(cat.pid, "through crun exec\n")
        box.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "through crun exec\n"
        sleeper = box.commands.run("sleep 60", background=True)
        assert sleeper.kill() is True
        with pytest.raises(CommandExitException):
            sleeper.wait()
    finally:
        box.kill()
