"""The unmodified ``e2b`` SDK's volumes (PyPI, pinned in pyproject.toml) against a live daemon: E2B's
Volume API on dsec's named volumes (ext4 images on loop devices), their content API with no sandbox,
and ``Sandbox.create(volume_mounts=...)``.

The content API runs as root on the host over files sandboxes wrote, so the symlinks a sandbox plants
are the point of one test: none may lead a read or a write out of the volume. Each test makes volumes
of its own (names with its pid); the module checks at its end that no volume's mount or loop device is
left on the host.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec.protocol.volumes import MIN_VOLUME_SIZE

from .conftest import Daemon, require_kind
from .test_volumes import settled, volume_loops, volume_mounts

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, Volume  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    SandboxException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

pytestmark = pytest.mark.timeout(300)
MOUNT = "/mnt/vol"


@pytest.fixture(scope="module")
def node(daemon: Daemon, e2b_env: dict[str, str]) -> Iterator[Daemon]:
    """The session's daemon with the SDK pointed at it (the content API too: the same listener); at the
    end, nothing of a volume may be left mounted or attached."""
    assert daemon.e2b_url is not None
    before = (volume_mounts(daemon.state_dir), volume_loops(daemon.state_dir))
    old = os.environ.get("E2B_VOLUME_API_URL")
    os.environ["E2B_VOLUME_API_URL"] = daemon.e2b_url
    try:
        yield daemon
    finally:
        if old is None:
            os.environ.pop("E2B_VOLUME_API_URL", None)
        else:
            os.environ["E2B_VOLUME_API_URL"] = old
    assert settled(daemon.state_dir) == before


def _name(request: pytest.FixtureRequest) -> str:
    return f"e2b-{request.node.name.removeprefix('test_')[:24].replace('_', '-')}-{os.getpid()}"


@pytest.fixture
def vol(node: Daemon, request: pytest.FixtureRequest) -> Iterator[Volume]:
    made = Volume.create(_name(request))
    yield made
    _remove(node, made.volume_id)


def _remove(node: Daemon, name: str) -> None:
    client = node.client()
    for info in client.list():
        if any(v.name == name for v in info.volumes):
            dsec.Sandbox.connect(info.id, client=client).kill()
    Volume.destroy(name)


def _in_sandbox(vol: Volume, script: str, name: str | None = None) -> str:
    """Run ``script`` in a sandbox that mounts ``vol`` at MOUNT (``name``: as named so, e.g. 'v:ro')."""
    with Sandbox.create(volume_mounts={MOUNT: name or vol}, timeout=300) as sbx:
        return sbx.commands.run(script).stdout


def test_the_content_api_and_sandboxes_share_a_volumes_files(node: Daemon, vol: Volume) -> None:
    assert vol.volume_id == vol.name and vol.token
    assert vol.name in {v.name for v in Volume.list()}
    vol.write_file("/hello.txt", "from the content API")
    vol.make_dir("/dir/sub", force=True)
    vol.write_file("/dir/sub/data.bin", bytes(range(256)))
    vol.write_file("/owned", "x", uid=1000, gid=1000, mode=0o600)
    with Sandbox.create(volume_mounts={MOUNT: vol}, timeout=300) as sbx:
        out = sbx.commands.run(f"cd {MOUNT} && cat hello.txt && echo && stat -c %u:%g:%a hello.txt owned dir")
        assert out.stdout.split("\n") == ["from the content API", "0:0:644", "1000:1000:600", "0:0:755", ""]
        assert (
            sbx.commands.run(f"od -An -tx1 {MOUNT}/dir/sub/data.bin | tr -d ' \\n'").stdout == bytes(range(256)).hex()
        )
        sbx.commands.run(f"echo from the sandbox > {MOUNT}/out.txt && mkdir {MOUNT}/made")
        assert sbx.get_info().volume_mounts == [{"name": vol.name, "path": MOUNT}]
        # a sandbox writes it: the content API reads along, and waits its turn to write
        assert vol.read_file("/out.txt") == "from the sandbox\n"
        with pytest.raises(VolumeException, match=f"409.*read-write by sandbox {sbx.sandbox_id}"):
            vol.write_file("/hello.txt", "not now")
    assert vol.read_file("/hello.txt") == "from the content API"
    names = [e.name for e in vol.list("/")]
    assert names == sorted(["dir", "hello.txt", "lost+found", "made", "out.txt", "owned"])
    made = vol.get_info("/made")
    assert (made.type.value, made.path, made.uid) == ("directory", "/made", 0)
    assert [e.path for e in vol.list("/dir", depth=2)] == ["/dir/sub", "/dir/sub/data.bin"]
    vol.update_metadata("/owned", uid=0, mode=0o644)
    vol.remove("/made")
    vol.remove("/dir")
    assert not vol.exists("/made") and not vol.exists("/dir/sub/data.bin")
    assert _in_sandbox(vol, f"ls {MOUNT}; stat -c %u:%a {MOUNT}/owned", name=f"{vol.name}:ro").split() == [
        "hello.txt",
        "lost+found",
        "out.txt",
        "owned",
        "0:644",
    ]


def test_symlinks_planted_by_a_sandbox_lead_nowhere_outside(node: Daemon, vol: Volume) -> None:
    passwd = Path("/etc/passwd")
    before = (hashlib.sha256(passwd.read_bytes()).hexdigest(), passwd.stat().st_mode)
    marker = f"pwned-{os.getpid()}"
    _in_sandbox(
        vol,
        f"cd {MOUNT} && ln -s / escape && ln -s ../../.. x && ln -s /etc/shadow shadow && ln -s /etc etc-link"
        " && ln -s ../../../../../../../etc/passwd far",
    )
    for path in ("/escape/etc/passwd", "/x/etc/passwd", "/shadow", "/etc-link/passwd", "/far", "/x/proc/1/environ"):
        with pytest.raises(VolumePathNotFoundException):
            vol.read_file(path)
    # "/" is the volume's root, whichever way a link names it
    assert {e.name for e in vol.list("/escape")} == {e.name for e in vol.list("/x")} == {e.name for e in vol.list("/")}
    vol.write_file(f"/escape/{marker}", "x")
    vol.write_file(f"/x/tmp/{marker}", "y")
    vol.write_file("/shadow", "replaces the link")
    with pytest.raises(VolumePathNotFoundException):  # it names the volume's /etc, which is not there
        vol.make_dir(f"/etc-link/{marker}", force=True)
    vol.make_dir("/etc")
    vol.make_dir(f"/etc-link/{marker}")
    assert vol.get_info(f"/etc/{marker}").type.value == "directory"  # in the volume's own /etc
    assert vol.read_file(f"/{marker}") == "x" and vol.read_file(f"/tmp/{marker}") == "y"
    assert vol.get_info("/shadow").type.value == "file"
    with pytest.raises(VolumePathNotFoundException):
        vol.update_metadata("/far", mode=0o777)
    link = vol.get_info("/escape")
    assert (link.type.value, link.target) == ("symlink", "/")
    vol.remove("/escape")  # the link, not what it names
    with pytest.raises(VolumeException, match="root"):
        vol.remove("/x/..")
    for host in (Path("/") / marker, Path("/tmp") / marker, Path("/etc") / marker):
        assert not host.exists(), host
    assert (hashlib.sha256(passwd.read_bytes()).hexdigest(), passwd.stat().st_mode) == before
    assert Path("/etc/shadow").stat().st_size > 0
    # and a sandbox sees what the content API wrote, in the volume
    assert _in_sandbox(vol, f"cat {MOUNT}/{marker} {MOUNT}/tmp/{marker}") == "xy"


def test_a_token_opens_its_own_volume_only(node: Daemon, vol: Volume, request: pytest.FixtureRequest) -> None:
    other = Volume.create(f"{_name(request)}-b")
    try:
        other.write_file("/f", "theirs")
        for token in (vol.token, "admin.wrong", "nonsense"):
            with pytest.raises(AuthenticationException):
                Volume(other.volume_id, other.name, token=token).read_file("/f")
            with pytest.raises(AuthenticationException):
                Volume(other.volume_id, other.name, token=token).write_file("/f", "mine")
        assert other.read_file("/f") == "theirs"
        assert Volume.connect(other.volume_id).read_file("/f") == "theirs"
    finally:
        _remove(node, other.volume_id)
    with pytest.raises(AuthenticationException):  # a removed volume's token opens nothing
        other.read_file("/f")


def test_refusals_reach_the_sdk_as_its_own_exceptions(node: Daemon, vol: Volume) -> None:
    with pytest.raises(VolumeNotFoundException) as missing:
        Volume.get_info(f"no-such-{os.getpid()}")
    assert isinstance(missing.value, NotFoundException)
    with pytest.raises(VolumeNotFoundException):
        Volume.connect(f"no-such-{os.getpid()}")
    assert Volume.destroy(f"no-such-{os.getpid()}") is False
    with pytest.raises(SandboxException, match=r"404.*no volume"):
        Sandbox.create(volume_mounts={MOUNT: f"no-such-{os.getpid()}"}, timeout=60)
    with Sandbox.create(volume_mounts={MOUNT: vol}, timeout=300) as writer:
        with pytest.raises(VolumeException, match=f"409.*{writer.sandbox_id}"):
            Volume.destroy(vol.volume_id)
        with pytest.raises(SandboxException, match=f"409.*read-write by sandbox {writer.sandbox_id}"):
            Sandbox.create(volume_mounts={"/w": vol}, timeout=60)
        with Sandbox.create(volume_mounts={"/r": f"{vol.name}:ro"}, timeout=300) as reader:
            res = reader.commands.run("touch /r/x 2>&1 || echo refused")
            assert "Read-only file system" in res.stdout and "refused" in res.stdout
    with pytest.raises(VolumeException, match="400"):
        Volume.create("Not A dsec Name")


def test_kinds_that_cannot_mount_volumes_are_refused(node: Daemon, vol: Volume) -> None:
    require_kind(node.client(), "microvm")
    with pytest.raises(SandboxException, match=r"400.*not supported for microvm"):
        Sandbox.create(metadata={"dsec.kind": "microvm"}, volume_mounts={MOUNT: vol}, timeout=60)


def test_the_quota_holds_for_the_content_api(node: Daemon, request: pytest.FixtureRequest) -> None:
    name = _name(request)
    node.client().create_volume(name, size=MIN_VOLUME_SIZE)  # E2B names no size: made with dsec's API
    small = Volume.connect(name)
    try:
        small.write_file("/keep", "kept")
        too_big = os.urandom(MIN_VOLUME_SIZE + (4 << 20))
        for path in ("/big", "/keep"):
            with pytest.raises(VolumeException, match=r"507.*is full"):
                small.write_file(path, too_big)
        assert not small.exists("/big")  # nothing half-written is left
        assert small.read_file("/keep") == "kept"  # and a failed overwrite left the old file
        assert [e.name for e in small.list("/")] == ["keep", "lost+found"]
        small.write_file("/fits", os.urandom(4 << 20))
        assert small.get_info("/fits").size == 4 << 20
    finally:
        _remove(node, name)
