"""One E2B script on each kind: the kind is chosen through the template (``IMAGE@KIND``) or the
``dsec.kind`` metadata key, and the SDK's calls behave the same on all of them. The microvm case boots
a real QEMU guest (TCG on this machine): one sandbox, every check in it."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import pytest

import dsec

from .conftest import Daemon, require_kind

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    FileNotFoundException,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

WAYS: dict[str, dict[str, Any]] = {
    "container": {"template": "dsec/debian:12"},
    "function": {"metadata": {"dsec.kind": "function"}},
    "microvm": {"template": "dsec/debian:12@microvm", "metadata": {"dsec.memory": "384Mi"}},
}


@pytest.mark.parametrize("kind", list(WAYS))
def test_the_same_script_on_every_kind(kind: str, daemon: Daemon, e2b_env: dict[str, str]) -> None:
    way = WAYS[kind]
    meta = {**way.get("metadata", {}), "dsec-test": f"kinds-{kind}"}
    require_kind(daemon.client(), kind)
    box = Sandbox.create(timeout=600, template=way.get("template"), metadata=meta)
    try:
        assert dsec.Sandbox.connect(box.sandbox_id, client=daemon.client()).info().kind == kind
        res = box.commands.run("echo $((6 * 7)); echo warn >&2")
        assert (res.exit_code, res.stdout, res.stderr) == (0, "42\n", "warn\n")
        with pytest.raises(CommandExitException) as failed:
            box.commands.run("exit 5")
        assert failed.value.exit_code == 5

        cat = box.commands.run("cat", background=True, stdin=True)
        box.commands.send_stdin(cat.pid, "fed live\n")
        box.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "fed live\n"

        sleeper = box.commands.run("sleep 300", background=True)
        assert sleeper.pid in {p.pid for p in box.commands.list()}
        assert box.commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException) as killed:
            sleeper.wait()
        assert killed.value.exit_code == -1
        assert box.commands.list() == []

        started = time.monotonic()
        with pytest.raises(TimeoutException):
            box.commands.run("sleep 120", timeout=3)
        assert time.monotonic() - started < 30

        blob = bytes(range(256)) * 1024
        box.files.write("/tmp/k/blob.bin", blob)
        assert bytes(box.files.read("/tmp/k/blob.bin", format="bytes")) == blob
        moved = box.files.rename("/tmp/k/blob.bin", "/tmp/k/sub/moved.bin")
        assert (moved.name, moved.size) == ("moved.bin", len(blob))
        assert box.files.get_info("/tmp/k/sub").type.value == "dir"
        assert [e.name for e in box.files.list("/tmp/k/sub")] == ["moved.bin"]
        assert box.commands.run("md5sum < /tmp/k/sub/moved.bin").stdout.split()[0] == _md5(blob)
        box.files.remove("/tmp/k")
        with pytest.raises(FileNotFoundException):
            box.files.read("/tmp/k/sub/moved.bin")

        seen: list[float] = []
        streamed = box.commands.run("echo a; sleep 1; echo b", on_stdout=lambda _: seen.append(time.monotonic()))
        assert streamed.stdout == "a\nb\n" and len(seen) == 2 and seen[1] - seen[0] > 0.5  # as it came

        tag = f"kinds-{kind}"
        box.set_timeout(400)
        listed = Sandbox.list(query=SandboxQuery(metadata={"dsec-test": tag})).next_items()
        assert [s.sandbox_id for s in listed] == [box.sandbox_id]
        assert 350 < (listed[0].end_at - datetime.now(UTC)).total_seconds() <= 400
        if kind == "function":
            with pytest.raises(SandboxException, match="cannot be paused"):
                box.pause()
        else:
            assert box.pause() is True and box.get_info().state.value == "paused"
            box.connect()
            assert box.commands.run("echo resumed").stdout == "resumed\n"
    finally:
        assert box.kill() is True
    assert box.kill() is False
    with pytest.raises(SandboxNotRunningException):
        box.commands.run("true")


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()
