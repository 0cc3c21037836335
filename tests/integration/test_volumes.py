"""Named volumes against a real daemon: ext4 images on loop devices, idmapped into container sandboxes.

Each test makes volumes of its own (names with its pid) and removes them; the module checks at its end
that no volume's mount or loop device is left on the host.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec.isolation.mounts import is_mountpoint
from dsec.protocol.volumes import MIN_VOLUME_SIZE

from .conftest import Daemon, release_node, require_kind, start_daemon
from .test_cli import dsec_cli

pytestmark = pytest.mark.timeout(300)

IMAGE = "dsec/busybox"


def _name(tag: str) -> str:
    return f"it-{tag}-{os.getpid()}"


def volume_mounts(state: Path) -> list[str]:
    """Mount points of volumes (their host mounts and the sandboxes' bundle views) under ``state``."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point.startswith(f"{state}/volumes/") or (
                point.startswith(f"{state}/sandboxes/") and "/volume-" in point
            ):
                found.append(point)
    return found


def volume_loops(state: Path) -> list[str]:
    """Loop devices whose backing file is a volume image under ``state``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            text = backing.read_text().strip()
        except OSError:
            continue
        if text.startswith(f"{state}/volumes/"):
            found.append(f"{backing.parts[3]}: {text}")
    return found


def settled(state: Path, timeout: float = 15.0) -> tuple[list[str], list[str]]:
    """What volumes still hold on the host once background unmounts had time to run."""
    deadline = time.monotonic() + timeout
    while True:
        mounts, loops = volume_mounts(state), volume_loops(state)
        if (not mounts and not loops) or time.monotonic() > deadline:
            return mounts, loops
        time.sleep(0.2)


@pytest.fixture(scope="module")
def node(daemon: Daemon) -> Iterator[Daemon]:
    """The session's daemon; at the end, nothing of a volume may be left mounted or attached."""
    before = (volume_mounts(daemon.state_dir), volume_loops(daemon.state_dir))
    yield daemon
    assert settled(daemon.state_dir) == before


@pytest.fixture
def client(node: Daemon) -> dsec.Client:
    return node.client()


@pytest.fixture
def volume(client: dsec.Client, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _name(request.node.name.removeprefix("test_")[:30].replace("_", "-"))
    client.create_volume(name, size="64Mi")
    yield name
    for info in client.list():
        if any(v.name == name for v in info.volumes):
            dsec.Sandbox.connect(info.id, client=client).kill()
    try:
        client.remove_volume(name)
    except dsec.VolumeNotFound:
        pass


def test_written_by_one_sandbox_read_by_a_later_one(client: dsec.Client, volume: str) -> None:
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as sb:
        assert sb.exec("echo from-exec > /data/a.txt && mkdir -p /data/d").ok
        sb.files.write("/data/d/b.txt", b"from-files")
        assert sb.files.read("/data/a.txt") == b"from-exec\n"
        assert {e.name for e in sb.files.list("/data")} >= {"a.txt", "d"}
        assert [e.path for e in sb.files.list("/data/d")] == ["/data/d/b.txt"]
        # what root writes is root's inside, whatever host range this sandbox had
        assert sb.exec("stat -c %u:%g /data/a.txt /data/d/b.txt").stdout.split() == ["0:0", "0:0"]
        assert sb.exec("chown 1000:1000 /data/d").ok  # handed to another account: kept so for the next
        info = sb.info()
        assert [(v.path, v.name, v.mode) for v in info.volumes] == [("/data", volume, "rw")]
        assert [(u.sandbox, u.mode) for u in client.volume(volume).users] == [(sb.id, "rw")]
    with dsec.Sandbox.create(IMAGE, volumes={"/in": (volume, "ro")}, client=client) as later:
        assert later.exec("cat /in/a.txt /in/d/b.txt").stdout == "from-exec\nfrom-files"
        assert later.exec("stat -c %u /in/a.txt /in/d").stdout.split() == ["0", "1000"]
    info = client.volume(volume)
    assert info.users == [] and info.size == 64 << 20 and info.used > 0
    assert volume in {v.name for v in client.volumes()}


def test_read_only_mount_refuses_writes(client: dsec.Client, volume: str) -> None:
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as writer:
        writer.files.write("/data/kept.txt", b"kept")
    with dsec.Sandbox.create(IMAGE, volumes={"/ro": [volume, "ro"]}, client=client) as sb:  # a list, as JSON has it
        res = sb.exec("touch /ro/new; echo x > /ro/kept.txt; rm /ro/kept.txt")
        assert res.stderr.count("Read-only file system") == 3, res.stderr
        # root inside cannot lift the flag: it is locked in the sandbox's user namespace
        res = sb.exec("mount -o remount,rw /ro && touch /ro/new")
        assert not res.ok
        for attempt in (
            lambda: sb.files.write("/ro/new", b"x"),
            lambda: sb.files.write("/ro/kept.txt", b"changed"),
            lambda: sb.files.mkdir("/ro/dir"),
            lambda: sb.files.remove("/ro/kept.txt"),
        ):
            with pytest.raises(dsec.InvalidRequest, match="read-only"):
                attempt()
        assert sb.files.read("/ro/kept.txt") == b"kept"
        assert sb.exec("ls /ro").stdout.split() == ["kept.txt", "lost+found"]


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_archives_in_and_out_of_volumes(client: dsec.Client, volume: str) -> None:
    """Archives are packed and unpacked inside the sandbox, so they see the volume as it does."""
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as sb:
        sb.files.upload_tar("/data/in", _tar({"a.txt": b"A", "sub/b.txt": b"B"}))
        assert sb.exec("cat /data/in/a.txt /data/in/sub/b.txt").stdout == "AB"
        with tarfile.open(fileobj=io.BytesIO(sb.files.download_tar("/data/in"))) as tar:
            assert sorted(m.name for m in tar.getmembers() if m.isfile()) == ["./a.txt", "./sub/b.txt"]
    with dsec.Sandbox.create(IMAGE, volumes={"/ro": (volume, "ro")}, client=client) as ro:
        with pytest.raises(dsec.InvalidRequest, match="Read-only file system"):
            ro.files.upload_tar("/ro/in", _tar({"c.txt": b"C"}))
        assert ro.exec("ls /ro/in").stdout.split() == ["a.txt", "sub"]


def test_one_writer_at_a_time_many_readers(client: dsec.Client, volume: str) -> None:
    first = dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client)
    try:
        with pytest.raises(dsec.VolumeInUse, match=f"read-write by sandbox {first.id}"):
            dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client)
        readers = [dsec.Sandbox.create(IMAGE, volumes={"/data": (volume, "ro")}, client=client) for _ in range(2)]
        first.exec("echo live > /data/live.txt")
        for r in readers:
            assert r.exec("cat /data/live.txt").stdout == "live\n"  # one file system: readers see the writer
        modes = sorted(u.mode for u in client.volume(volume).users)
        assert modes == ["ro", "ro", "rw"]
        for r in readers:
            r.kill()
    finally:
        first.kill()
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as second:  # the writer is gone
        assert second.exec("cat /data/live.txt").stdout == "live\n"


def test_the_next_sandbox_sees_what_the_last_one_wrote_at_once(client: dsec.Client, volume: str) -> None:
    """A killed sandbox's mount namespace may outlive its kill for a moment, holding the volume's file
    system after the host's mount is gone: the next mount must reach that same file system, or it reads
    the image without the last writes (and two file systems would write over one file)."""
    for i in range(6):
        with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as sb:
            assert sb.exec(f"cat /data/n 2>/dev/null; echo {i} > /data/n").stdout == (f"{i - 1}\n" if i else "")


def test_a_file_system_outliving_its_host_mount_is_mounted_again(
    client: dsec.Client, node: Daemon, volume: str, tmp_path: Path
) -> None:
    """The same, made certain: a bind held here stands for a dying sandbox's namespace while the last
    user ends and the host's mount goes; the next sandbox must get that very file system."""
    host_mount = node.state_dir / "volumes" / "mnt" / volume
    held = tmp_path / "held"
    held.mkdir()
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as sb:
        subprocess.run(["mount", "--bind", str(host_mount), str(held)], check=True)
        sb.exec("echo unflushed > /data/f")  # in the page cache and the journal, not yet in place
    try:
        deadline = time.monotonic() + 15
        while is_mountpoint(host_mount) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_mountpoint(host_mount), "the unused volume was not unmounted from the host"
        loops = volume_loops(node.state_dir)
        assert len(loops) == 1  # still attached: the held file system keeps it
        with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as again:
            assert again.exec("cat /data/f").stdout == "unflushed\n"
            again.exec("echo second > /data/g")
            assert volume_loops(node.state_dir) == loops  # the same device, so the same file system
        assert (held / "g").read_text() == "second\n"
    finally:
        subprocess.run(["umount", str(held)], check=True)


def test_size_quota_is_enforced(client: dsec.Client, node: Daemon) -> None:
    name = _name("quota")
    client.create_volume(name, size=MIN_VOLUME_SIZE)
    try:
        with dsec.Sandbox.create(IMAGE, volumes={"/q": name}, disk="256Mi", client=client) as sb:
            res = sb.exec("dd if=/dev/zero of=/q/big bs=1M count=64", timeout=60)
            assert not res.ok and "No space left on device" in res.stderr, res.stderr
            written = int(sb.exec("stat -c %s /q/big").stdout)
            assert 0 < written <= MIN_VOLUME_SIZE
            with pytest.raises(dsec.LimitExceeded):
                sb.files.write("/q/more", b"x" * (4 << 20))
            # the sandbox's own disk is untouched by the volume's writes
            assert sb.exec("dd if=/dev/zero of=/root/own bs=1M count=32").ok
        image = node.state_dir / "volumes" / "images" / f"{name}.ext4"
        assert os.stat(image).st_size == MIN_VOLUME_SIZE
        assert os.stat(image).st_blocks * 512 <= MIN_VOLUME_SIZE  # nothing beyond its size on the node's disk
    finally:
        client.remove_volume(name)


def test_remove_refused_while_in_use(client: dsec.Client, node: Daemon) -> None:
    name = _name("rm")
    client.create_volume(name, size="32Mi")
    image = node.state_dir / "volumes" / "images" / f"{name}.ext4"
    sb = dsec.Sandbox.create(IMAGE, volumes={"/data": (name, "ro")}, client=client)
    try:
        with pytest.raises(dsec.VolumeInUse, match=sb.id):
            client.remove_volume(name)
        assert sb.exec("ls /data").ok
    finally:
        sb.kill()
    client.remove_volume(name)
    assert not image.exists()
    with pytest.raises(dsec.VolumeNotFound):
        client.volume(name)
    with pytest.raises(dsec.VolumeNotFound):
        dsec.Sandbox.create(IMAGE, volumes={"/data": name}, client=client)
    client.create_volume(_name("dup"), size="16Mi")
    try:
        with pytest.raises(dsec.VolumeExists):
            client.create_volume(_name("dup"), size="32Mi")
    finally:
        client.remove_volume(_name("dup"))


def test_paths_through_a_volume_stay_inside(client: dsec.Client, volume: str) -> None:
    host_marker = Path("/etc") / f"dsec-volume-escape-{os.getpid()}"
    with dsec.Sandbox.create(IMAGE, volumes={"/data": volume}, client=client) as sb:
        assert sb.exec("ln -s /etc/passwd /data/abs && ln -s ../../../../../../etc /data/up && ln -s / /data/root").ok
        # inside the sandbox they are the sandbox's own files
        assert "root:" in sb.exec("cat /data/abs").stdout
        # the file API resolves them in the volume's root: never the host's, never outside the volume
        for path in ("/data/abs", "/data/up/passwd", "/data/root/etc/passwd", "/data/../../etc/shadow"):
            try:
                data = sb.files.read(path)
            except (dsec.FileNotFoundInSandbox, dsec.InvalidRequest):
                continue
            assert data == sb.exec(f"cat {path}").stdout.encode(), path  # only ever the sandbox's view
        for path in (f"/data/up/{host_marker.name}", f"/data/root/etc/{host_marker.name}"):
            try:
                sb.files.write(path, b"escaped?")
            except (dsec.FileNotFoundInSandbox, dsec.InvalidRequest):
                pass
        assert not host_marker.exists()
        # the volume's root is not an entry the file API may remove or move
        with pytest.raises(dsec.InvalidRequest, match="mounted"):
            sb.files.remove("/data", recursive=True)
        assert sb.exec("ls /data/abs").ok


def test_a_function_sandbox_mounts_volumes_on_a_worker_of_its_own(client: dsec.Client, volume: str) -> None:
    require_kind(client, "function")
    with dsec.Sandbox.create(IMAGE, kind="function", volumes={"/data": volume}, client=client) as sb:
        assert sb.exec("echo from-function > /data/f.txt").ok
        assert sb.files.read("/data/f.txt") == b"from-function\n"
        assert [(v.path, v.name, v.mode) for v in sb.info().volumes] == [("/data", volume, "rw")]
        with pytest.raises(dsec.VolumeInUse):
            dsec.Sandbox.create(IMAGE, kind="function", volumes={"/data": volume}, client=client)
        # the file API keeps to the volume's root in a function sandbox too
        assert sb.exec("ln -s /etc /data/up").ok
        with pytest.raises((dsec.FileNotFoundInSandbox, dsec.InvalidRequest)):
            sb.files.write(f"/data/up/dsec-volume-escape-{os.getpid()}", b"escaped?")
        assert not (Path("/etc") / f"dsec-volume-escape-{os.getpid()}").exists()
    with dsec.Sandbox.create(IMAGE, kind="function", volumes={"/ro": (volume, "ro")}, client=client) as ro:
        assert ro.exec("cat /ro/f.txt").stdout == "from-function\n"
        assert "Read-only file system" in ro.exec("touch /ro/x").stderr
    with dsec.Sandbox.create(IMAGE, volumes={"/c": volume}, client=client) as container:
        assert container.exec("cat /c/f.txt").stdout == "from-function\n"
    # no worker that held the volume went back to a pool: a pooled function sandbox sees no /data
    with dsec.Sandbox.create(IMAGE, kind="function", client=client) as plain:
        assert plain.exec("ls /data /ro").exit_code != 0
    assert client.volume(volume).users == []


def test_kinds_that_cannot_mount_volumes_say_so(client: dsec.Client, volume: str) -> None:
    for kind in ("microvm", "vm"):
        if kind not in client.health().kinds:
            continue
        require_kind(client, kind)
        with pytest.raises(dsec.InvalidRequest, match=f"not supported for {kind} sandboxes"):
            dsec.Sandbox.create(IMAGE, kind=kind, volumes={"/data": volume}, client=client)
    assert client.volume(volume).users == []


def test_volumes_survive_a_daemon_restart() -> None:
    """A sandbox still running after a restart keeps its mount and its hold on the volume."""
    state = Path(tempfile.mkdtemp(prefix="dsec-vol-restart-"))
    d = start_daemon(state)
    try:
        client = d.client()
        client.create_volume("keep", size="32Mi")
        sb = dsec.Sandbox.create(IMAGE, volumes={"/data": "keep"}, client=client)
        sb.exec("echo before > /data/f")
        d.stop(signal.SIGKILL)
        d = start_daemon(state)
        client = d.client()
        again = dsec.Sandbox.connect(sb.id, client=client)
        assert again.info().state == dsec.State.running
        assert again.exec("cat /data/f").stdout == "before\n"
        assert again.files.read("/data/f") == b"before\n"
        again.files.write("/data/g", b"after")
        assert [(u.sandbox, u.mode) for u in client.volume("keep").users] == [(sb.id, "rw")]
        with pytest.raises(dsec.VolumeInUse):
            dsec.Sandbox.create(IMAGE, volumes={"/data": "keep"}, client=client)
        with pytest.raises(dsec.VolumeInUse):
            client.remove_volume("keep")
        again.kill()
        with dsec.Sandbox.create(IMAGE, volumes={"/v": ("keep", "ro")}, client=client) as reader:
            assert reader.exec("cat /v/f /v/g").stdout == "before\nafter"
        client.remove_volume("keep")
        assert settled(state) == ([], [])
    finally:
        d.stop()
        release_node(state)
        shutil.rmtree(state, ignore_errors=True)


def test_the_cli(client: dsec.Client) -> None:
    name = _name("cli")
    made = dsec_cli("volume", "create", name, "--size", "32Mi")
    assert made.returncode == 0 and name in made.stdout, made.stderr
    assert name in dsec_cli("volume", "ls").stdout
    ran = dsec_cli("run", "--image", IMAGE, "--volume", f"/v={name}", "echo hi > /v/f && cat /v/f")
    assert ran.returncode == 0 and ran.stdout == "hi\n", ran.stderr
    ran = dsec_cli("run", "--image", IMAGE, "--volume", f"/v={name}:ro", "touch /v/g")
    assert ran.returncode != 0 and "Read-only file system" in ran.stderr
    assert '"users": []' in dsec_cli("volume", "inspect", name).stdout
    bad = dsec_cli("run", "--image", IMAGE, "--volume", "/proc/v=x", "true")
    assert bad.returncode == 2 and "invalid_request" in bad.stderr
    assert dsec_cli("volume", "rm", name).returncode == 0
    missing = dsec_cli("volume", "inspect", name)
    assert missing.returncode == 2 and "volume_not_found" in missing.stderr
