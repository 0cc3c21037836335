"""Exec, files, errors and lifecycle: identical across kinds."""

from __future__ import annotations

import pytest

import dsec


def test_exit_codes_and_streams(sb: dsec.Sandbox) -> None:
    res = sb.exec("echo out; echo err >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr, res.signal) == (3, "out\n", "err\n", None)
    assert sb.exec(["/bin/echo", "argv", "list"]).stdout == "argv list\n"
    assert sb.exec(["/no/such/binary"]).exit_code == 127
    killed = sb.exec("kill -9 $$")
    assert (killed.signal == 9 and killed.exit_code is None) or killed.exit_code == 137


def test_env_cwd_stdin(sb: dsec.Sandbox) -> None:
    res = sb.exec("pwd; echo $GREETING; cat", cwd="/tmp", env={"GREETING": "hi"}, stdin="from stdin")
    assert res.stdout == "/tmp\nhi\nfrom stdin"
    bad = sb.exec("true", cwd="/does/not/exist")
    assert bad.exit_code != 0


def test_output_is_capped_head_and_tail(sb: dsec.Sandbox) -> None:
    res = sb.exec("head -c 3000000 /dev/zero | tr '\\0' a; echo END", output_limit=65536)
    assert res.truncated and res.stdout.startswith("aaa") and res.stdout.endswith("END\n")
    assert res.stdout_bytes == 3000004
    assert len(res.stdout.encode()) <= 65536 + 200


def test_timeout_kills_the_tree(sb: dsec.Sandbox) -> None:
    res = sb.exec("sleep 300 & sleep 301", timeout=1.5)
    assert res.timed_out
    assert "sleep 30" not in sb.exec("ps -o args 2>/dev/null || ps").stdout


def test_files_round_trip(sb: dsec.Sandbox) -> None:
    payload = bytes(range(256)) * 64
    sb.files.write("/data/sub/blob.bin", payload)
    assert sb.files.read("/data/sub/blob.bin") == payload
    sb.files.mkdir("/data/empty")
    names = {e.name: e for e in sb.files.list("/data")}
    assert names["sub"].type == "dir" and names["empty"].type == "dir"
    assert {e.name: e.size for e in sb.files.list("/data/sub")} == {"blob.bin": len(payload)}
    assert sb.exec("md5sum /data/sub/blob.bin").stdout.split()[0] == __import__("hashlib").md5(payload).hexdigest()
    tar = sb.files.download_tar("/data")
    sb.files.upload_tar("/copy", tar)
    assert sb.files.read("/copy/sub/blob.bin") == payload
    sb.files.remove("/copy", recursive=True)
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/copy/sub/blob.bin")


def test_file_errors(sb: dsec.Sandbox) -> None:
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/no/such/file")
    with pytest.raises(dsec.InvalidRequest, match="is a directory"):
        sb.files.read("/data")
    sb.files.mkdir("/full")
    sb.files.write("/full/x", b"x")
    with pytest.raises(dsec.InvalidRequest, match="not empty"):
        sb.files.remove("/full")
    with pytest.raises(dsec.InvalidRequest):
        sb.files.read("relative/path")


def test_bad_input_is_refused_before_it_runs(sb: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidRequest):
        sb.exec("true", timeout=-1)
    with pytest.raises(dsec.InvalidRequest):
        sb.exec([])
