from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec


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


def test_traversal_and_symlinks_stay_inside(sb: dsec.Sandbox, tmp_path: Path) -> None:
    marker = f"dsec-escape-{os.getpid()}-{id(tmp_path)}"
    host_target = Path("/tmp") / marker
    sb.exec("ln -s / /tmp/rootlink; ln -s /tmp /tmp/tmplink; ln -s ../../../../../../tmp /work-up")
    sb.files.write(f"/tmp/rootlink/tmp/{marker}", b"x")
    sb.files.write(f"/../../../../tmp/{marker}-dots", b"x")
    sb.files.write(f"/work-up/{marker}-rel", b"x")
    assert not host_target.exists()
    assert not Path(f"/tmp/{marker}-dots").exists()
    assert not Path(f"/tmp/{marker}-rel").exists()
    # all three landed inside the sandbox
    listing = sb.exec("ls /tmp").stdout
    assert marker in listing and f"{marker}-dots" in listing and f"{marker}-rel" in listing
    # reading host files through links or .. is impossible: /etc/hostname is the sandbox's
    sb.exec("ln -s /proc/1/root /tmp/procroot")
    assert sb.files.read("/../../etc/hostname") == b"sandbox\n"
    with pytest.raises(dsec.DsecError):
        sb.files.read("/tmp/procroot/etc/hostname")  # magic links are refused


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


def test_write_beyond_disk_limit(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(disk="8Mi")
    with pytest.raises(dsec.LimitExceeded):
        sb.files.write("/big.bin", b"\0" * (16 << 20))
    res = sb.exec("dd if=/dev/zero of=/fill bs=1M count=32")
    assert res.exit_code != 0 and "No space left" in res.stderr
    sb.exec("rm -f /fill /big.bin")
    sb.files.write("/small", b"ok")
    assert sb.files.read("/small") == b"ok"
