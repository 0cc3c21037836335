from __future__ import annotations

import os
import subprocess
import sys

import dsec


def dsec_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsec", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env or dict(os.environ),
    )


def test_help_for_every_command(daemon: object) -> None:
    for cmd in ("serve", "run", "ps", "exec", "rm", "images", "version", "demo", "bench"):
        res = dsec_cli(cmd, "--help")
        assert res.returncode == 0, res.stderr
        assert "Usage" in res.stdout


def test_run_ps_exec_rm(daemon: object) -> None:
    res = dsec_cli("run", "--image", "dsec/busybox", "echo one-shot; exit 7")
    assert res.stdout == "one-shot\n" and res.returncode == 7
    sb = dsec.Sandbox.create(image="dsec/busybox", labels={"cli": "yes"})
    try:
        ps = dsec_cli("ps", "--label", "cli=yes")
        assert sb.id in ps.stdout
        ex = dsec_cli("exec", sb.id, "echo streamed; exit 2")
        assert ex.stdout == "streamed\n" and ex.returncode == 2
        rm = dsec_cli("rm", sb.id)
        assert rm.returncode == 0
        assert sb.info().state == dsec.State.stopped
    finally:
        sb.kill()
    bad = dsec_cli("exec", "sb-000000000000", "true")
    assert bad.returncode == 2 and "sandbox_not_found" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_images_lists_builtins(daemon: object) -> None:
    res = dsec_cli("images")
    assert res.returncode == 0
    assert "dsec/busybox:latest" in res.stdout and "dsec/debian:12" in res.stdout
