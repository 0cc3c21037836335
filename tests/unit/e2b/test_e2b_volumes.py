"""E2B's volumes over dsec's, with no root: the real ``e2b`` SDK's Volume class against the E2B app on a
loopback server, the volumes "mounted" by a fake host as plain directories (the real ext4 images, quotas
and sandbox mounts are tests/integration/test_e2b_volumes.py's). And the translation rules alone."""

from __future__ import annotations

import io
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dsec.core.manager import SandboxManager
from dsec.core.volume_files import checked_mode, inside, owner_of
from dsec.e2b.auth import VolumeTokens
from dsec.e2b.control import volumes_of
from dsec.e2b.control_models import VolumeMount
from dsec.errors import InvalidRequest
from dsec.protocol.volumes import DEFAULT_VOLUME_SIZE, MIN_VOLUME_SIZE, VolumeCreate
from dsec.store.records import VolumeMount as Mounted
from dsec.tenancy import OPERATOR, Caller

from ...fakes.backend import FakeBackend
from ...fakes.volumes import FakeHost
from ..conftest import IMAGE, TOKEN

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, AsyncVolume  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    SandboxException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

Served = tuple[str, SandboxManager, FakeBackend]


@pytest.fixture
async def node(served: Served, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Served]:
    """The served app, its volumes on a fake host; the SDK's content calls go to the same listener."""
    base, mgr, _ = served
    mgr.volumes.host = FakeHost()
    monkeypatch.setenv("E2B_VOLUME_API_URL", base)
    yield served


def _opts(base: str, key: str = TOKEN) -> dict[str, str]:
    return {"api_key": key, "api_url": base, "sandbox_url": base}


async def test_the_sdk_makes_fills_reads_and_destroys_a_volume(node: Served) -> None:
    base, mgr, _ = node
    vol = await AsyncVolume.create("data", **_opts(base))
    assert (vol.volume_id, vol.name) == ("data", "data") and vol.token
    assert mgr.volume("data").size == DEFAULT_VOLUME_SIZE  # E2B names no size: dsec's default
    assert [(v.volume_id, v.name) for v in await AsyncVolume.list(**_opts(base))] == [("data", "data")]
    assert (await AsyncVolume.get_info("data", **_opts(base))).token == vol.token
    written = await vol.write_file("/docs/a.txt", "hello", mode=0o600)
    assert (written.type.value, written.path, written.name, written.size, written.mode) == (
        "file",
        "/docs/a.txt",
        "a.txt",
        5,
        0o600,
    )
    assert await vol.read_file("docs/a.txt") == "hello"  # a relative path is from the volume's root
    assert b"".join([c async for c in await vol.read_file("/docs/a.txt", format="stream")]) == b"hello"
    big = os.urandom(3 << 20)
    await vol.write_file("/big.bin", io.BytesIO(big))  # streamed up, in parts
    assert await vol.read_file("/big.bin", format="bytes") == big
    assert (await vol.make_dir("/x/y", force=True, mode=0o700)).mode == 0o700
    with pytest.raises(VolumePathNotFoundException):
        await vol.make_dir("/nope/z")  # no parents without force
    with pytest.raises(VolumeException, match="already exists"):
        await vol.make_dir("/x/y")
    assert [e.path for e in await vol.list("/")] == ["/big.bin", "/docs", "/x"]
    assert [e.path for e in await vol.list("/", depth=2)] == ["/big.bin", "/docs", "/docs/a.txt", "/x", "/x/y"]
    assert (await vol.update_metadata("/docs/a.txt", mode=0o640)).mode == 0o640
    await vol.remove("/docs")
    assert not await vol.exists("/docs/a.txt") and await vol.exists("/x/y")
    with pytest.raises(VolumePathNotFoundException):
        await vol.get_info("/docs")
    with pytest.raises(VolumePathNotFoundException):
        await vol.read_file("/docs/a.txt")
    with pytest.raises(VolumeException, match="root"):
        await vol.remove("/x/..")
    with pytest.raises(VolumeNotFoundException):
        await AsyncVolume.get_info("nope", **_opts(base))
    assert await AsyncVolume.destroy("data", **_opts(base)) is True
    assert await AsyncVolume.destroy("data", **_opts(base)) is False
    await AsyncVolume.create("taken", **_opts(base))
    with pytest.raises(VolumeException, match="409"):
        await AsyncVolume.create("taken", **_opts(base))
    with pytest.raises(VolumeException, match="400"):
        await AsyncVolume.create("Upper Case", **_opts(base))


async def test_a_token_opens_one_volume_for_one_tenant(node: Served) -> None:
    base, mgr, _ = node
    _, alice_key = mgr.tenants.add("alice")
    _, bob_key = mgr.tenants.add("bob")
    mine = await AsyncVolume.create("alices", **_opts(base, alice_key))
    theirs = await AsyncVolume.create("bobs", **_opts(base, bob_key))
    await theirs.write_file("/f", "bob's")
    with pytest.raises(VolumeNotFoundException):
        await AsyncVolume.get_info("bobs", **_opts(base, alice_key))  # another tenant's: not there
    for token in (mine.token, "garbage", f"bob.{mine.token.partition('.')[2]}", ""):
        with pytest.raises(AuthenticationException):
            await AsyncVolume("bobs", "bobs", token=token).read_file("/f")
    with pytest.raises(AuthenticationException):  # a missing volume is answered alike: no probing names
        await AsyncVolume("nothing", "nothing", token=mine.token).read_file("/f")
    await mgr.create_volume(VolumeCreate(name="shared", size=MIN_VOLUME_SIZE))  # the operator's
    await (await AsyncVolume.connect("shared", **_opts(base))).write_file("/data", "for all")
    read_only = await AsyncVolume.connect("shared", **_opts(base, alice_key))
    assert await read_only.read_file("/data") == "for all"
    with pytest.raises(VolumeException, match="403"):
        await read_only.write_file("/data", "mine now")
    assert mgr.tenants.revoke("alice")
    with pytest.raises(AuthenticationException):
        await mine.read_file("/x")  # a removed tenant's tokens open nothing
    await AsyncVolume.destroy("bobs", **_opts(base, bob_key))
    again = await AsyncVolume.create("bobs", **_opts(base, bob_key))
    with pytest.raises(AuthenticationException):
        await theirs.read_file("/f")  # the token of the volume that was removed
    assert again.token != theirs.token
    assert (await again.write_file("/g", "new")).size == 3  # the new volume's token opens it


def _plant(mnt: Path, secret: Path) -> None:
    """What a sandbox could leave in the volume: symlinks to the host's root, up and out, and to a host file."""
    secret.write_text("host secret")
    (mnt / "escape").symlink_to("/")
    (mnt / "up").symlink_to("../../../../../..")
    (mnt / "sec").symlink_to(secret)
    (mnt / "rel").symlink_to(os.path.relpath(secret, mnt))


def _host_untouched(secret: Path) -> bool:
    st = secret.stat()
    return (
        secret.read_text() == "host secret"
        and st.st_mode & 0o777 != 0o777
        and not Path("/pwned").exists()
        and not (secret.parent / "pwned2").exists()
        and Path("/etc").is_dir()
    )


async def test_planted_symlinks_never_lead_out_of_the_volume(node: Served, workdir: Path) -> None:
    base, mgr, _ = node
    vol = await AsyncVolume.create("v", **_opts(base))
    await vol.write_file("/plain", "inside")
    mnt, secret = mgr.volumes.mount_point("v"), workdir / "secret"
    _plant(mnt, secret)
    for path in ("/sec", "/rel", "/escape/etc/hostname", "/up/etc/hostname", f"/up{secret}"):
        with pytest.raises(VolumePathNotFoundException):
            await vol.read_file(path)
    assert await vol.read_file("/escape/plain") == "inside"  # "/" is the volume's root
    await vol.write_file("/escape/pwned", "x")
    await vol.write_file("/up/pwned2", "x")
    assert [e.path for e in await vol.list("/") if e.name.startswith("pwned")] == ["/pwned", "/pwned2"]
    await vol.write_file("/sec", "replaced")  # the link is replaced, never what it names
    assert await vol.read_file("/sec") == "replaced"
    with pytest.raises(VolumePathNotFoundException):
        await vol.update_metadata("/rel", mode=0o777)
    link = await vol.get_info("/escape")
    assert (link.type.value, link.target) == ("symlink", "/")
    await vol.remove("/escape")
    assert not await vol.exists("/escape")
    assert _host_untouched(secret)


async def test_mounts_at_creation_and_the_one_writer_rule(node: Served) -> None:
    base, mgr, _ = node
    vol = await AsyncVolume.create("v", **_opts(base))
    await vol.write_file("/seed", "from the content API")
    box = await AsyncSandbox.create(IMAGE, volume_mounts={"/mnt/vol": vol}, **_opts(base))
    assert mgr.record(box.sandbox_id).volumes == [Mounted("/mnt/vol", "v", False, str(mgr.volumes.mount_point("v")))]
    assert (await box.get_info()).volume_mounts == [{"name": "v", "path": "/mnt/vol"}]
    assert await vol.read_file("/seed") == "from the content API"  # reads go on while a sandbox writes
    with pytest.raises(VolumeException, match=r"409.*read-write by sandbox"):
        await vol.write_file("/seed", "refused")
    with pytest.raises(VolumeException, match=r"409.*kill them first"):
        await AsyncVolume.destroy("v", **_opts(base))
    with pytest.raises(SandboxException, match=r"409.*one writer at a time"):
        await AsyncSandbox.create(IMAGE, volume_mounts={"/w": "v"}, **_opts(base))
    reader = await AsyncSandbox.create(IMAGE, volume_mounts={"/r": "v:ro"}, **_opts(base))
    assert [m.read_only for m in mgr.record(reader.sandbox_id).volumes] == [True]
    with pytest.raises(SandboxException, match="404"):
        await AsyncSandbox.create(IMAGE, volume_mounts={"/w": "missing"}, **_opts(base))
    with pytest.raises(SandboxException, match="400"):
        await AsyncSandbox.create(IMAGE, volume_mounts={"/w": "v:rx"}, **_opts(base))
    with pytest.raises(SandboxException, match=r"400.*volume mount path"):
        await AsyncSandbox.create(IMAGE, volume_mounts={"/proc/x": "v:ro"}, **_opts(base))
    await box.kill()
    await vol.write_file("/seed", "the writer is gone")  # now the content API may write
    await reader.kill()
    assert await AsyncVolume.destroy("v", **_opts(base)) is True


def test_volume_mounts_become_a_creations_volumes() -> None:
    mounts = [
        VolumeMount(name="a", path="/a"),
        VolumeMount(name="b:ro", path="/b"),
        VolumeMount(name="c:rw", path="/c"),
    ]
    assert volumes_of(mounts) == {"/a": "a", "/b": ("b", "ro"), "/c": "c"}
    assert volumes_of(None) == {}
    with pytest.raises(InvalidRequest, match="NAME:ro"):
        volumes_of([VolumeMount(name="a:rx", path="/a")])
    with pytest.raises(InvalidRequest, match="named twice"):
        volumes_of([VolumeMount(name="a", path="/a"), VolumeMount(name="b", path="/a")])


def test_volume_tokens() -> None:
    tokens = VolumeTokens(b"k" * 32)
    made = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    alice = Caller("alice")
    token = tokens.token(alice, "v", made)
    assert token.startswith("alice.") and tokens.opens(token, alice, "v", made)
    assert not tokens.opens(token, alice, "w", made)  # another volume
    assert not tokens.opens(token, alice, "v", made.replace(microsecond=0))  # the volume made again
    assert not tokens.opens(token, Caller("bob"), "v", made)
    assert not VolumeTokens(b"o" * 32).opens(token, alice, "v", made)  # another daemon's key
    assert tokens.token(OPERATOR, "v", made).startswith("admin.")


def test_content_paths_owners_and_modes() -> None:
    assert [inside(p) for p in ("a/b", "/a/../b", "/", ".", "//x/")] == ["/a/b", "/b", "/", "/", "/x"]
    for bad in ("", "a\0b", "/" + "x" * 5000):
        with pytest.raises(InvalidRequest):
            inside(bad)
    assert owner_of(None, None) is None and owner_of(1000, None) == (1000, 0)
    with pytest.raises(InvalidRequest, match="uid"):
        owner_of(-1, 0)
    assert checked_mode(None, 0o644) == 0o644 and checked_mode(0o4755, 0) == 0o4755
    with pytest.raises(InvalidRequest, match="mode"):
        checked_mode(0o10000, 0)
