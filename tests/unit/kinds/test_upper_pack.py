"""pack-upper (upper_pack.c): an overlayfs upper directory as an OCI layer tar, the way a microvm guest packs
its changes for pack_diff. Built here like the guest agent; the trees are made by a real overlayfs mount."""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import stat
import struct
import subprocess
import tarfile
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.images.tar_extract import extract_tar

SOURCE = Path(__file__).resolve().parents[3] / "src/dsec/kinds/microvm/upper_pack.c"
# -Werror: the guest build uses the agent's flags, and a warning there must fail here first
CFLAGS = ["-static", "-O2", "-Wall", "-Wextra", "-Werror"]
OWNER = (1234, 5678)
LONG_DIR = "long/" + "d" * 60
LONG_FILE = f"{LONG_DIR}/" + "f" * 80
LONG_TARGET = "/" + "t" * 150
# a v2 file capability granting cap_net_raw (bit 13) permitted
CAP_NET_RAW = struct.pack("<IIIII", 0x02000000, 1 << 13, 0, 0, 0)


@pytest.fixture(scope="module")
def pack_upper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (gcc) to build pack-upper")
    out = tmp_path_factory.mktemp("pack-upper") / "pack-upper"
    res = subprocess.run([cc, *CFLAGS, "-o", str(out), str(SOURCE)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs, as under the guest's upper directory: trusted and user xattrs, device nodes."""
    if os.geteuid() != 0:
        pytest.skip("needs root: tmpfs and overlayfs mounts, whiteout devices, trusted xattrs")
    root = tmp_path / "fs"
    root.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@contextmanager
def overlay(
    lower: Path, upper: Path, work: Path, merged: Path, features: str = "redirect_dir=off,metacopy=off"
) -> Iterator[Path]:
    for d in (upper, work, merged):
        d.mkdir()
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},{features}"
    res = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount overlayfs: {res.stderr.strip()}")
    try:
        yield merged
    finally:
        subprocess.run(["umount", str(merged)], check=True)


def run(binary: Path, *args: str | Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, check=False, timeout=60)


def pack(binary: Path, *args: str | Path) -> tuple[bytes, str]:
    res = run(binary, *args)
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout, res.stderr.decode()


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8", errors="surrogateescape") as tf:
        infos = tf.getmembers()
    names = [m.name for m in infos]
    assert len(names) == len(set(names)), "a name appears twice"
    return {m.name: m for m in infos}


def content(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        f = tf.extractfile(name)
        assert f is not None
        return f.read()


# ---- a real overlayfs upper directory ----------------------------------------------------------------------


def make_lower(lower: Path) -> None:
    for d in ("olddir/sub", "deldir", "dir", "skip"):
        (lower / d).mkdir(parents=True)
    for name, text in {
        "keep.txt": "kept\n",
        "modify.txt": "old\n",
        "gone.txt": "gone\n",
        "chmodme": "#!/bin/sh\n",
        "owned.txt": "owned\n",
        "olddir/a": "a\n",
        "olddir/sub/c": "c\n",
        "deldir/x": "x\n",
        "dir/lower.txt": "lower\n",
    }.items():
        (lower / name).write_text(text)
    (lower / "chmodme").chmod(0o755)


def change_through(m: Path) -> bytes:
    """The sandbox's changes, made through the merged mount; returns big.bin's contents."""
    (m / "new.txt").write_bytes(b"new\n")
    os.chown(m / "new.txt", *OWNER)
    os.setxattr(m / "new.txt", "user.note", b"hello")
    os.utime(m / "new.txt", (1_600_000_000, 1_600_000_000))
    with open(m / "modify.txt", "a") as f:
        f.write("appended\n")
    (m / "chmodme").chmod(0o4755)
    os.chown(m / "owned.txt", *OWNER)
    os.symlink("keep.txt", m / "link")
    os.symlink(LONG_TARGET, m / "longlink")
    (m / "hl1").write_bytes(b"linked\n")
    os.link(m / "hl1", m / "dir" / "hl2")
    os.mkfifo(m / "pipe", 0o640)
    (m / "gone.txt").unlink()
    shutil.rmtree(m / "deldir")
    shutil.rmtree(m / "olddir")
    (m / "olddir").mkdir()
    (m / "olddir" / "fresh.txt").write_bytes(b"fresh\n")
    (m / LONG_DIR).mkdir(parents=True)
    (m / LONG_FILE).write_bytes(b"long\n")
    big = os.urandom(3 << 20)
    (m / "big.bin").write_bytes(big)
    for d, mode in (("shared", 0o1777), ("grp", 0o2775)):
        (m / d).mkdir()
        (m / d).chmod(mode)
    os.mknod(m / "sock", stat.S_IFSOCK | 0o644)
    os.mknod(m / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (m / "skip" / "me.txt").write_bytes(b"excluded\n")
    return big


@pytest.fixture
def upper(scratch: Path) -> tuple[Path, bytes]:
    lower = scratch / "lower"
    lower.mkdir()
    make_lower(lower)
    up = scratch / "upper"
    with overlay(lower, up, scratch / "work", scratch / "merged") as merged:
        big = change_through(merged)
    return up, big


EXPECTED = {
    ".",
    "./.wh.deldir",
    "./.wh.gone.txt",
    "./big.bin",
    "./chmodme",
    "./dir",
    "./dir/hl2",
    "./grp",
    "./hl1",
    "./link",
    "./long",
    f"./{LONG_DIR}",
    f"./{LONG_FILE}",
    "./longlink",
    "./modify.txt",
    "./new.txt",
    "./olddir",
    "./olddir/.wh..wh..opq",
    "./olddir/fresh.txt",
    "./owned.txt",
    "./pipe",
    "./shared",
}


def test_overlay_upper_as_layer(pack_upper: Path, upper: tuple[Path, bytes]) -> None:
    up, big = upper
    data, err = pack(pack_upper, "--exclude", "skip", up)
    ms = members(data)
    assert set(ms) == EXPECTED
    assert "./sock" in err and "./null" in err and "1:3" in err
    assert "./skip" not in err  # excluded quietly

    raw = [m.name for m in tarfile.open(fileobj=io.BytesIO(data)).getmembers()]
    assert raw[0] == "."
    assert raw[raw.index("./olddir") + 1] == "./olddir/.wh..wh..opq"  # the marker before the new contents
    assert "./dir/.wh..wh..opq" not in ms  # copied up, still merged with the lower dir

    for name in ("./.wh.deldir", "./.wh.gone.txt", "./olddir/.wh..wh..opq"):
        assert ms[name].isreg() and ms[name].size == 0
    assert ms["./chmodme"].mode == 0o4755 and ms["./chmodme"].isreg()
    assert ms["./shared"].isdir() and ms["./shared"].mode == 0o1777
    assert ms["./grp"].mode == 0o2775
    assert (ms["./new.txt"].uid, ms["./new.txt"].gid) == OWNER
    assert (ms["./owned.txt"].uid, ms["./owned.txt"].gid) == OWNER
    assert ms["./modify.txt"].uid == 0
    assert ms["./new.txt"].mtime == 1_600_000_000
    assert ms["./link"].issym() and ms["./link"].linkname == "keep.txt"
    assert ms["./longlink"].issym() and ms["./longlink"].linkname == LONG_TARGET
    assert ms["./pipe"].isfifo() and ms["./pipe"].mode == 0o640
    # sorted walk: dir/ comes before hl1, so dir/hl2 carries the data
    assert ms["./dir/hl2"].isreg() and ms["./dir/hl2"].size == 7
    assert ms["./hl1"].islnk() and ms["./hl1"].linkname == "./dir/hl2"
    assert ms[f"./{LONG_FILE}"].pax_headers["path"] == f"./{LONG_FILE}"

    assert content(data, "./big.bin") == big
    assert content(data, "./modify.txt") == b"old\nappended\n"
    assert content(data, f"./{LONG_FILE}") == b"long\n"
    assert content(data, "./dir/hl2") == b"linked\n"

    # overlayfs's bookkeeping stays out; the user's own xattrs go in
    assert os.getxattr(up / "olddir", "trusted.overlay.opaque") == b"y"
    assert any(k.startswith("trusted.overlay.") for k in os.listxattr(up / "owned.txt"))
    assert ms["./new.txt"].pax_headers.get("SCHILY.xattr.user.note") == "hello"
    leaked = [(m.name, k) for m in ms.values() for k in m.pax_headers if "overlay" in k]
    assert leaked == []

    again, _ = pack(pack_upper, "--exclude", "skip", up)
    assert again == data

    listing = subprocess.run(["tar", "-tvf", "-"], input=data, capture_output=True, check=False)
    assert listing.returncode == 0, listing.stderr
    names = subprocess.run(["tar", "-tf", "-"], input=data, capture_output=True, check=True).stdout
    assert [n.rstrip("/") for n in names.decode().splitlines()] == raw
    assert b"./hl1 link to ./dir/hl2" in listing.stdout


def test_host_importer_rebuilds_the_upper(pack_upper: Path, upper: tuple[Path, bytes], scratch: Path) -> None:
    up, _ = upper
    data, _ = pack(pack_upper, "--exclude", "skip", up)
    dest = scratch / "imported"
    stats = extract_tar(io.BytesIO(data), dest, label="upper")
    assert stats.whiteouts == 2 and stats.opaque_dirs == 1 and stats.hardlinks == 1
    assert [s for s in stats.skipped if "xattr" in s] == []
    # the importer does not make FIFOs; everything else must come back as overlayfs wrote it
    assert [s.split(":")[0] for s in stats.skipped] == ["./pipe"]
    left_out = {"sock", "null", "skip", "skip/me.txt", "pipe"}
    assert_same_tree(up, dest, left_out)
    assert os.stat(dest / "hl1").st_ino == os.stat(dest / "dir" / "hl2").st_ino


def tree(root: Path) -> dict[str, os.stat_result]:
    found = {"": os.lstat(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            found[str(p.relative_to(root))] = os.lstat(p)
    return found


def assert_same_tree(src: Path, dest: Path, left_out: set[str]) -> None:
    want = {k: v for k, v in tree(src).items() if k not in left_out}
    got = tree(dest)
    assert set(got) == set(want)
    for rel, a in want.items():
        b = got[rel]
        assert stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode), rel
        if stat.S_ISCHR(a.st_mode):
            assert a.st_rdev == b.st_rdev == 0, rel
            continue
        assert (a.st_mode, a.st_uid, a.st_gid) == (b.st_mode, b.st_uid, b.st_gid), rel
        if not stat.S_ISLNK(a.st_mode):
            assert int(a.st_mtime) == int(b.st_mtime), rel
            assert user_xattrs(src / rel) == user_xattrs(dest / rel), rel
        if stat.S_ISREG(a.st_mode):
            assert (src / rel).read_bytes() == (dest / rel).read_bytes(), rel
        elif stat.S_ISLNK(a.st_mode):
            assert os.readlink(src / rel) == os.readlink(dest / rel), rel
        elif stat.S_ISDIR(a.st_mode):
            assert opaque(src / rel) == opaque(dest / rel), rel


def user_xattrs(p: Path) -> dict[str, bytes]:
    kept = ("user.", "security.capability")
    return {k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith(kept) and not k.startswith("user.overlay.")}


def opaque(p: Path) -> bytes | None:
    try:
        return os.getxattr(p, "trusted.overlay.opaque")
    except OSError:
        return None


@pytest.mark.parametrize("feature", ["redirect_dir", "metacopy"])
def test_uppers_that_need_their_lower_layers_refused(pack_upper: Path, scratch: Path, feature: str) -> None:
    lower = scratch / "lower"
    (lower / "d").mkdir(parents=True)
    (lower / "d" / "f").write_bytes(b"data\n")
    up = scratch / "upper"
    with overlay(lower, up, scratch / "work", scratch / "merged", f"{feature}=on") as m:
        if feature == "redirect_dir":
            (m / "d").rename(m / "moved")  # only a redirect xattr: d's files stay in the lower layer
        else:
            os.chown(m / "d" / "f", *OWNER)  # only the metadata is copied up
    res = run(pack_upper, up)
    assert res.returncode == 1
    assert f"{feature}=off".encode() in res.stderr


# ---- corner cases on a tree made directly --------------------------------------------------------------


def test_fields_beyond_ustar(pack_upper: Path, scratch: Path) -> None:
    root = scratch / "t"
    root.mkdir()
    exact = "n" * 98  # "./" + 98: a name filling the whole ustar field, without a NUL
    (root / exact).write_bytes(b"")
    (root / ("n" * 99)).write_bytes(b"")
    (root / "big-ids").write_bytes(b"ids\n")
    os.chown(root / "big-ids", 3_000_000, 4_000_000)
    (root / "old").write_bytes(b"")
    os.utime(root / "old", (-86_400, -86_400))
    (root / "future").write_bytes(b"")
    os.utime(root / "future", (2**34, 2**34))
    latin1 = os.fsencode("x" * 120) + b"\xe9"  # not UTF-8, and long enough for a PAX path
    with open(os.fsencode(root) + b"/" + latin1, "wb") as f:
        f.write(b"latin\n")
    (root / "cap").write_bytes(b"")
    os.setxattr(root / "cap", "security.capability", CAP_NET_RAW)
    (root / "trusted").write_bytes(b"")
    os.setxattr(root / "trusted", "trusted.other", b"1")  # neither overlayfs's nor kept

    data, err = pack(pack_upper, root)
    assert err == ""
    ms = members(data)
    assert ms[f"./{exact}"].pax_headers == {} and f"./{'n' * 99}" in ms
    ids = ms["./big-ids"]
    assert (ids.uid, ids.gid) == (3_000_000, 4_000_000)
    assert ids.pax_headers["uid"] == "3000000"
    assert ms["./old"].mtime == -86_400
    assert ms["./future"].mtime == 2**34
    assert ms["./" + os.fsdecode(latin1)].size == 6
    assert ms["./cap"].pax_headers["SCHILY.xattr.security.capability"].encode("utf-8", "surrogateescape") == (
        CAP_NET_RAW
    )
    assert ms["./trusted"].pax_headers == {}

    dest = scratch / "imported"
    stats = extract_tar(io.BytesIO(data), dest, label="t")
    assert stats.skipped == []
    assert os.getxattr(dest / "cap", "security.capability") == CAP_NET_RAW
    assert os.stat(dest / "big-ids").st_uid == 3_000_000
    assert os.stat(dest / "future").st_mtime == 2**34


def test_whiteout_forms_and_reserved_names(pack_upper: Path, scratch: Path) -> None:
    root = scratch / "t"
    (root / "d").mkdir(parents=True)
    os.mknod(root / "d" / "dev-whiteout", stat.S_IFCHR, os.makedev(0, 0))
    (root / "d" / "xattr-whiteout").write_bytes(b"")
    os.setxattr(root / "d" / "xattr-whiteout", "trusted.overlay.whiteout", b"")
    os.setxattr(root / "d", "trusted.overlay.opaque", b"x")  # "holds xattr whiteouts", not opaque
    (root / ".wh.planted").write_bytes(b"")
    (root / "o").mkdir()
    os.setxattr(root / "o", "trusted.overlay.opaque", b"y")
    (root / "o" / "a").write_bytes(b"a")

    data, err = pack(pack_upper, root)
    assert set(members(data)) == {".", "./d", "./d/.wh.dev-whiteout", "./d/.wh.xattr-whiteout", "./o"} | {
        "./o/.wh..wh..opq",
        "./o/a",
    }
    assert "./.wh.planted" in err


def test_excludes_and_mounts_inside(pack_upper: Path, scratch: Path) -> None:
    root = scratch / "t"
    for d in ("a/b", "keep/b", "mnt"):
        (root / d).mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"")
    (root / "keep" / "b" / "f").write_bytes(b"")
    (root / "top").write_bytes(b"")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / "mnt")], check=True)
    try:
        (root / "mnt" / "inner").write_bytes(b"")
        data, err = pack(pack_upper, "--exclude", "./a/b/", "--exclude=/top", root)
    finally:
        subprocess.run(["umount", str(root / "mnt")], check=True)
    assert set(members(data)) == {".", "./a", "./keep", "./keep/b", "./keep/b/f"}
    assert "./mnt" in err and "mounted" in err


def test_sizes_beyond_ustar_and_a_reader_going_away(pack_upper: Path, scratch: Path) -> None:
    root = scratch / "t"
    root.mkdir()
    size = (8 << 30) + 1  # one byte over what 11 octal digits hold; sparse on tmpfs
    with open(root / "huge", "wb") as f:
        f.truncate(size)
    with subprocess.Popen([str(pack_upper), str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        head = proc.stdout.read(8192)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 1
    assert "writing the archive" in err
    with tarfile.open(fileobj=io.BytesIO(head), mode="r:") as tf:
        assert tf.next() is not None
        huge = tf.next()
    assert huge is not None and huge.name == "./huge" and huge.size == size
    assert huge.pax_headers["size"] == str(size)


def pack_mid_file(binary: Path, root: Path, change: Callable[[], None]) -> tuple[bytes, str]:
    """Run pack-upper into a small pipe left unread until it is full, which stops the packer in the middle of
    the first big file's data; make ``change`` there, then let it finish."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)
    size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
    with subprocess.Popen([str(binary), str(root)], stdout=w, stderr=subprocess.PIPE) as proc:
        os.close(w)
        deadline = time.monotonic() + 30
        while struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0" * 4))[0] < size:
            assert time.monotonic() < deadline and proc.poll() is None, "pack-upper did not fill the pipe"
            time.sleep(0.01)
        change()
        with os.fdopen(r, "rb") as f:
            data = f.read()
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0, err
    return data, err


@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_file_changing_while_read(pack_upper: Path, tmp_path: Path, change: str) -> None:
    root = tmp_path / "t"
    root.mkdir()
    size = 8 << 20  # far more than the packer's buffer and the pipe together
    (root / "a").write_bytes(b"x" * size)
    (root / "b").write_bytes(b"after\n")

    def act() -> None:
        if change == "shrink":
            os.truncate(root / "a", 1000)
        else:
            with open(root / "a", "ab") as f:
                f.write(b"y" * 4096)

    data, err = pack_mid_file(pack_upper, root, act)
    ms = members(data)
    assert ms["./a"].size == size  # the header was out before the change: the member keeps it
    a = content(data, "./a")
    if change == "shrink":
        assert "./a shrank while packing" in err
        kept = a.rstrip(b"\0")
        assert 1000 <= len(kept) < size and kept == b"x" * len(kept)
    else:
        assert "./a grew while packing" in err
        assert a == b"x" * size
    assert content(data, "./b") == b"after\n"  # the archive stays in step
    extract_tar(io.BytesIO(data), tmp_path / "imported", label="t")


def test_bad_invocations(pack_upper: Path, tmp_path: Path) -> None:
    for args in ((), ("--bogus", str(tmp_path)), (str(tmp_path), str(tmp_path)), ("--exclude",)):
        res = run(pack_upper, *args)
        assert res.returncode == 2, args
        assert b"usage: pack-upper" in res.stderr and res.stdout == b""
    assert run(pack_upper, "--exclude", ".", tmp_path).returncode == 2

    missing = tmp_path / "missing"
    res = run(pack_upper, missing)
    assert res.returncode == 1 and res.stdout == b""
    assert str(missing).encode() in res.stderr and b"No such file" in res.stderr
    (tmp_path / "file").write_bytes(b"")
    res = run(pack_upper, tmp_path / "file")
    assert res.returncode == 1 and b"Not a directory" in res.stderr

    res = run(pack_upper, "--help")
    assert res.returncode == 0 and res.stdout.startswith(b"usage: pack-upper")


def test_empty_directory(pack_upper: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    data, err = pack(pack_upper, tmp_path / "empty")
    assert err == "" and len(data) == 3 * 512  # the root's header, then the two end-of-archive blocks
    assert list(members(data)) == ["."]
