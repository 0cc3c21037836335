"""Exec, files, errors and lifecycle: identical across kinds."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

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


def test_string_and_argv(sb: dsec.Sandbox) -> None:
    assert sb.exec("echo $((6*7))").stdout == "42\n"
    # argv is not interpreted by a shell
    assert sb.exec(["echo", "$((6*7))", "a b"]).stdout == "$((6*7)) a b\n"


def test_stderr_separate(sb: dsec.Sandbox) -> None:
    res = sb.exec("echo out; echo err >&2")
    assert res.stdout == "out\n" and res.stderr == "err\n"


def test_streaming_delivers_output_as_it_comes(sb: dsec.Sandbox) -> None:
    arrivals = []
    started = time.monotonic()
    for event in sb.exec_stream("echo first; sleep 1; echo second"):
        if event.type == "stdout":
            arrivals.append((event.data, time.monotonic() - started))
        last = event
    assert [a[0] for a in arrivals] == ["first\n", "second\n"]
    assert arrivals[1][1] - arrivals[0][1] > 0.5  # the first line came before the sleep ended
    assert last.type == "result" and last.result is not None and last.result.exit_code == 0


def test_concurrent_execs_in_one_sandbox(sb: dsec.Sandbox) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: sb.exec(f"echo {i}"), range(16)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]


def test_background_process_survives_its_step_without_timeout(sb: dsec.Sandbox) -> None:
    res = sb.exec("sleep 300 >/dev/null 2>&1 &")
    assert res.exit_code == 0
    assert "sleep 300" in sb.exec("ps -o args").stdout
    # another exec timing out does not kill it
    sb.exec("sleep 10", timeout=0.5)
    assert "sleep 300" in sb.exec("ps -o args").stdout


def test_binary_round_trip_list_remove(sb: dsec.Sandbox) -> None:
    data = os.urandom(3 << 20)
    sb.files.write("/work/deep/dir/blob.bin", data, mode=0o600)
    assert sb.files.read("/work/deep/dir/blob.bin") == data
    entries = {e.name: e for e in sb.files.list("/work/deep/dir")}
    assert entries["blob.bin"].size == len(data) and entries["blob.bin"].mode == 0o600
    assert entries["blob.bin"].type == "file"
    # the sandbox sees what the API wrote, and the API sees what the sandbox wrote
    assert sb.exec("wc -c < /work/deep/dir/blob.bin").stdout.strip() == str(len(data))
    sb.exec("echo made-inside > /work/inside.txt")
    assert sb.files.read("/work/inside.txt") == b"made-inside\n"
    sb.files.remove("/work/deep/dir/blob.bin")
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/work/deep/dir/blob.bin")
    with pytest.raises(dsec.InvalidRequest):
        sb.files.remove("/work")  # not empty
    sb.files.remove("/work", recursive=True)
    assert sb.exec("test -e /work").exit_code == 1


def test_missing_file_is_filenotfound(sb: dsec.Sandbox) -> None:
    with pytest.raises(FileNotFoundError):
        sb.files.read("/nope/nothing")


@pytest.mark.parametrize("bad", ["relative/path", "", "/a\0b"])
def test_bad_paths_are_invalid(sb: dsec.Sandbox, bad: str) -> None:
    with pytest.raises(dsec.InvalidRequest):
        sb.files.read(bad)


def test_tar_upload_download(sb: dsec.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "bin.dat").write_bytes(bytes(range(256)) * 100)
    os.symlink("pkg/mod.py", src / "link.py")
    sb.files.upload_dir(src, "/project")
    assert sb.exec("cat /project/link.py").stdout == "x = 1\n"
    out = tmp_path / "out"
    sb.files.download_dir("/project", out)
    assert (out / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert (out / "bin.dat").read_bytes() == bytes(range(256)) * 100


def test_hostile_tar_stays_inside(sb: dsec.Sandbox) -> None:
    marker = f"dsec-tar-escape-{os.getpid()}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in (f"../../../../tmp/{marker}", f"/tmp/{marker}-abs"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo("escape")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc"
        tar.addfile(link)
        dev = tarfile.TarInfo("null2")
        dev.type = tarfile.CHRTYPE
        dev.devmajor, dev.devminor = 1, 3
        tar.addfile(dev)
    try:
        sb.files.upload_tar("/dst", buf.getvalue())
    except dsec.InvalidRequest:
        pass  # refusing part of the archive is fine; escaping is not
    assert not Path(f"/tmp/{marker}").exists()
    assert not Path(f"/tmp/{marker}-abs").exists()
    assert sb.exec("test -c /dst/null2").exit_code != 0  # mknod is not allowed in a sandbox
