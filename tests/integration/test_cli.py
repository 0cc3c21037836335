from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

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
    commands = ("serve", "run", "ps", "exec", "rm", "images", "version", "demo", "bench", "snapshot", "image")
    for cmd in (*commands, "pause", "resume", "fork", "rollback", "checkpoint"):
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


def test_pause_resume_fork(daemon: object) -> None:
    sb = dsec.Sandbox.create(image="dsec/busybox", labels={"cli": "pause"})
    try:
        assert dsec_cli("pause", sb.id).returncode == 0
        ps = dsec_cli("ps", "--label", "cli=pause", "--json")
        assert '"state": "paused"' in ps.stdout
        assert dsec_cli("resume", sb.id).returncode == 0 and sb.info().state == dsec.State.running
        # a container's copies carry its files, not its processes: asked for, a clear error, no traceback
        fork = dsec_cli("fork", sb.id, "-n", "2", "--processes")
        assert fork.returncode == 2 and "files only" in fork.stderr and "Traceback" not in fork.stderr
        sb.exec("echo kept > /kept")
        made = dsec_cli("checkpoint", "create", sb.id, "--name", "start")
        assert made.returncode == 0 and made.stdout.startswith("c1 "), made.stderr
        listed = dsec_cli("checkpoint", "ls", sb.id, "--json")
        assert [(c["id"], c["name"]) for c in json.loads(listed.stdout)] == [("c1", "start")]
        sb.exec("rm /kept")
        assert dsec_cli("rollback", sb.id, "start").returncode == 0
        assert sb.exec("cat /kept").stdout == "kept\n"
        copies = dsec_cli("fork", sb.id, "-n", "2", "--checkpoint", "c1")
        ids = copies.stdout.split()
        assert copies.returncode == 0 and len(ids) == 2, copies.stderr
        for sid in ids:
            assert dsec.Sandbox.connect(sid).exec("cat /kept").stdout == "kept\n"
            assert dsec_cli("rm", sid).returncode == 0
        missing = dsec_cli("rollback", sb.id, "nope")
        assert missing.returncode == 2 and "checkpoint_not_found" in missing.stderr
        assert dsec_cli("checkpoint", "rm", sb.id, "c1").returncode == 0
        assert dsec_cli("checkpoint", "ls", sb.id, "--json").stdout.strip() == "[]"
        bad = dsec_cli("fork", sb.id, "-n", "0")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        gone = dsec_cli("pause", "sb-000000000000")
        assert gone.returncode == 2 and "sandbox_not_found" in gone.stderr
    finally:
        sb.kill()


def test_images_lists_builtins(daemon: object) -> None:
    res = dsec_cli("images")
    assert res.returncode == 0
    assert "dsec/busybox:latest" in res.stdout and "dsec/debian:12" in res.stdout


def test_image_commands(daemon: object, tmp_path: Path) -> None:
    tag = secrets.token_hex(4)
    sb = dsec.Sandbox.create(image="dsec/busybox")
    try:
        sb.exec("echo from-cli > /marker && echo h > /root/.ash_history")
        snap = dsec_cli("snapshot", sb.id, f"test/cli-snap:{tag}", "--scrub", "marker-none")
        assert snap.returncode == 0, snap.stderr
        assert f"test/cli-snap:{tag}" in snap.stdout and "paths scrubbed" in snap.stdout
    finally:
        sb.kill()
    ls = dsec_cli("image", "ls", "--json")
    assert ls.returncode == 0 and f"test/cli-snap:{tag}" in ls.stdout
    history = dsec_cli("image", "history", f"test/cli-snap:{tag}", "--json")
    assert history.returncode == 0 and '"source_sandbox"' in history.stdout and sb.id in history.stdout
    stats = dsec_cli("image", "stats", f"test/cli-snap:{tag}", "--json")
    assert stats.returncode == 0 and '"exposed_fraction"' in stats.stdout
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'name = "test/cli-built:{tag}"\nfrom = "test/cli-snap:{tag}"\n\n[[steps]]\nrun = "cat /marker > /copied"\n'
    )
    built = dsec_cli("image", "build", str(spec))
    assert built.returncode == 0, built.stderr
    with dsec.Sandbox.create(image=f"test/cli-built:{tag}") as child:
        assert child.exec("cat /copied").stdout == "from-cli\n"
    again = dsec_cli("image", "build", str(spec))
    assert again.returncode == 2 and "image_exists" in again.stderr and "Traceback" not in again.stderr
    for name in (f"test/cli-built:{tag}", f"test/cli-snap:{tag}"):
        assert dsec_cli("image", "rm", name).returncode == 0
    gc = dsec_cli("image", "gc")
    assert gc.returncode == 0 and "deleted" in gc.stdout
    missing = dsec_cli("image", "inspect", f"test/cli-snap:{tag}")
    assert missing.returncode == 2 and "image_not_found" in missing.stderr
    bad = dsec_cli("image", "import", str(tmp_path / "nothing.tar"), "test/x:1")
    assert bad.returncode == 2 and "nothing to import" in bad.stderr


def test_names_and_ids_are_whole_in_a_narrow_terminal_and_in_a_pipe(daemon: object) -> None:
    """A table shrinks its other columns, never a name or an id (`dsec image ls` showed `dsec/busyb…`)."""
    sb = dsec.Sandbox.create(image="dsec/busybox", labels={"cli": "narrow"})
    try:
        for columns in ("30", "80"):  # a narrow terminal; a pipe (rich's 80 columns)
            env = {**os.environ, "COLUMNS": columns}
            images = dsec_cli("image", "ls", env=env)
            assert images.returncode == 0, images.stderr
            assert "dsec/busybox" in images.stdout and "dsec/debian:12" in images.stdout, images.stdout
            ps = dsec_cli("ps", "--label", "cli=narrow", env=env)
            assert sb.id in ps.stdout and "dsec/busybox" in ps.stdout, ps.stdout
            row = next(line for line in ps.stdout.splitlines() if sb.id in line)
            assert "dsec/busybox:latest" in row, row  # whole on the sandbox's own line
    finally:
        sb.kill()
