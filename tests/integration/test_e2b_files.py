"""The unmodified ``e2b`` SDK (PyPI, pinned) on what E2B's file API tells and does beyond reads and writes:
entries with owner, group, mode and symlink targets, the depth-first deep listing, removing what is not
there, user metadata, signed file URLs, and exact watch events (inotify) on the kinds whose files the
host can open; a VM keeps its polled watch and refuses metadata."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import Daemon, require_kind

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, FileType, Sandbox  # noqa: E402
from e2b.exceptions import InvalidArgumentException  # noqa: E402

WAYS: dict[str, dict[str, Any]] = {
    "container": {"template": "dsec/debian:12"},
    "function": {"metadata": {"dsec.kind": "function"}},
    "microvm": {"template": "dsec/debian:12@microvm", "metadata": {"dsec.memory": "384Mi"}},
}
HOST_FILES = ["container", "function"]  # kinds whose files the daemon opens itself: metadata, inotify


def _box(kind: str, daemon: Daemon, **kwargs: Any) -> Sandbox:
    require_kind(daemon.client(), kind)
    way = WAYS[kind]
    return Sandbox.create(timeout=600, template=way.get("template"), metadata=way.get("metadata"), **kwargs)


@pytest.fixture
def box(request: pytest.FixtureRequest, daemon: Daemon, e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    sbx = _box(request.param, daemon)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("box", list(WAYS), indirect=True)
def test_entries_as_envd_describes_them(box: Sandbox) -> None:
    for d in ("t/s1/s1a", "t/s1/s1b", "t/s2/s2a"):
        box.files.make_dir(f"/tmp/{d}")
    box.files.write("/tmp/t/file.txt", "hello")
    box.commands.run(
        "useradd -M -U alice && chown alice:alice /tmp/t/file.txt && cd /tmp/t && ln -s file.txt link"
        " && ln -s /tmp/t/s1 dirlink && ln -s nowhere dangling",
        user="root",
    )
    # depth first, each directory by name: a directory, then what it holds; links are not entered
    deep = [e.path.removeprefix("/tmp/t/") for e in box.files.list("/tmp/t", depth=2)]
    assert deep == ["dangling", "dirlink", "file.txt", "link", "s1", "s1/s1a", "s1/s1b", "s2", "s2/s2a"]

    info = box.files.get_info("/tmp/t/file.txt")
    assert (info.type, info.size, info.mode, info.permissions) == (FileType.FILE, 5, 0o644, "-rw-r--r--")
    assert (info.owner, info.group, info.symlink_target) == ("alice", "alice", None)
    folder = box.files.get_info("/tmp/t/s1")
    assert (folder.type, folder.owner, folder.permissions) == (FileType.DIR, "root", "drwxr-xr-x")
    # a symlink: envd sends the target's type and the absolute target (this SDK shows is_symlink as SYMLINK)
    link = box.files.get_info("/tmp/t/link")
    assert (link.type, link.symlink_target) == (FileType.SYMLINK, "/tmp/t/file.txt")
    listed = {e.name: e for e in box.files.list("/tmp/t")}
    assert listed["dirlink"].symlink_target == "/tmp/t/s1" and listed["dangling"].symlink_target == "/tmp/t/nowhere"
    assert listed["file.txt"].owner == "alice" and listed["s2"].owner == "root"

    box.files.write("/.dotted", "at the root")  # a name at the root may start with a dot
    assert (box.files.get_info("/.dotted").path, [e.path for e in box.files.list("/") if e.name == ".dotted"]) == (
        "/.dotted",
        ["/.dotted"],
    )
    box.files.remove("/.dotted")

    box.files.remove("/tmp/t/not-there")  # envd: removing what is not there succeeds
    box.files.remove("/tmp/no-parent/not-there")
    box.files.remove("/tmp/t")
    assert not box.files.exists("/tmp/t")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("box", HOST_FILES, indirect=True)
def test_metadata_is_kept_with_the_file(box: Sandbox) -> None:
    written = box.files.write("/tmp/m/a.txt", "a", metadata={"Author": "me", "purpose": "test"})
    assert written.metadata == {"author": "me", "purpose": "test"}  # keys lowercased, as envd keeps them
    assert box.files.get_info("/tmp/m/a.txt").metadata == {"author": "me", "purpose": "test"}
    assert {e.name: e.metadata for e in box.files.list("/tmp/m")} == {"a.txt": {"author": "me", "purpose": "test"}}
    assert box.files.rename("/tmp/m/a.txt", "/tmp/m/b.txt").metadata == {"author": "me", "purpose": "test"}
    # what the sandbox sees: the attributes themselves; what it sets is metadata too
    got = box.commands.run("python3 -c \"import os; print(os.getxattr('/tmp/m/b.txt', 'user.e2b.author'))\"")
    assert got.stdout.strip() == "b'me'"
    box.commands.run("python3 -c \"import os; os.setxattr('/tmp/m/b.txt', 'user.e2b.stage', b'set inside')\"")
    assert box.files.get_info("/tmp/m/b.txt").metadata == {"author": "me", "purpose": "test", "stage": "set inside"}
    # an upload replaces the metadata: none given, none left
    assert box.files.write("/tmp/m/b.txt", "again").metadata is None
    assert box.files.get_info("/tmp/m/b.txt").metadata is None
    both = box.files.write_files(
        [{"path": "/tmp/m/1", "data": "1"}, {"path": "/tmp/m/2", "data": "2"}], metadata={"batch": "x"}
    )
    assert [i.metadata for i in both] == [{"batch": "x"}, {"batch": "x"}]
    with pytest.raises(InvalidArgumentException):
        box.files.write("/tmp/m/bad", "x", metadata={"bad key": "v"})
    assert not box.files.exists("/tmp/m/bad")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _with_query(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query)) | changes
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


@pytest.mark.timeout(600)
def test_signed_urls_open_one_file_for_one_operation_until_they_expire(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    one, other = _box("container", daemon, secure=True), _box("container", daemon, secure=True)
    try:
        one.files.write("/tmp/s.txt", "one's")
        other.files.write("/tmp/s.txt", "other's")
        # the URL names no sandbox (one endpoint for all): the signature's token finds it
        assert _get(one.download_url("/tmp/s.txt")) == (200, b"one's")
        assert _get(other.download_url("/tmp/s.txt", use_signature_expiration=60)) == (200, b"other's")
        expired = one.download_url("/tmp/s.txt", use_signature_expiration=-120)
        status, body = _get(expired)
        assert (status, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
        # the signature covers the path, the operation, the user and the expiration
        signed = one.download_url("/tmp/s.txt", use_signature_expiration=60)
        for changed in (
            _with_query(signed, path="/etc/passwd"),
            _with_query(signed, username="root"),
            _with_query(signed, signature_expiration=str(int(time.time()) + 86400)),
            _with_query(signed, signature="v1_" + "A" * 43),
            _with_query(signed, signature=""),
        ):
            assert _get(changed)[0] in (400, 401), changed
        upload = one.upload_url("/tmp/up.txt", use_signature_expiration=60)
        assert _get(upload)[0] == 401  # a write signature does not read
        sent = httpx.post(upload, files={"file": ("up.txt", b"uploaded")}, timeout=30)
        assert sent.status_code == 200, sent.text
        assert one.files.read("/tmp/up.txt") == "uploaded" and not other.files.exists("/tmp/up.txt")
        assert httpx.post(one.download_url("/tmp/x.txt"), content=b"x", timeout=30).status_code == 401
        # no signature and no access token: nothing
        assert _get(_with_query(signed, signature="", signature_expiration=""))[0] in (400, 401, 502)
    finally:
        one.kill()
        other.kill()
    assert _get(signed)[0] in (401, 502)  # the sandbox is gone: so is what its token signed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("box", HOST_FILES, indirect=True)
def test_watches_report_every_change_as_it_happens(box: Sandbox) -> None:
    box.files.make_dir("/tmp/w")
    handle = box.files.watch_dir("/tmp/w", recursive=True)
    box.commands.run("cd /tmp/w && : > blink && rm blink && mkdir -p a/b")
    time.sleep(0.3)  # the new directories are watched once their creation is read
    box.commands.run("cd /tmp/w && echo x > a/b/f && mv a/b/f g && chmod 600 g")
    time.sleep(0.3)
    events = [(e.type.value, e.name) for e in handle.get_new_events()]
    # a file made and removed at once, which no look at the directory would ever see
    assert events[:2] == [("create", "blink"), ("remove", "blink")]
    assert [e for e in events if e[1] in ("a", "a/b", "a/b/f", "g")] == [
        ("create", "a"),
        ("create", "a/b"),
        ("create", "a/b/f"),
        ("write", "a/b/f"),
        ("rename", "a/b/f"),
        ("create", "g"),
        ("chmod", "g"),
    ]
    box.files.write("/tmp/w/api.txt", "through the API")
    assert ("create", "api.txt") in [(e.type.value, e.name) for e in handle.get_new_events()]
    handle.stop()

    async def streamed() -> list[Any]:
        sbx = await AsyncSandbox.connect(box.sandbox_id)
        seen: list[Any] = []
        watch = await sbx.files.watch_dir("/tmp/w", on_event=seen.append, include_entry=True)
        await sbx.commands.run("echo more >> /tmp/w/g")
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.1)
        await watch.stop()
        return seen

    seen = asyncio.run(streamed())
    assert [(e.type.value, e.name) for e in seen][:1] == [("write", "g")]
    assert seen[0].entry is not None and (seen[0].entry.path, seen[0].entry.mode) == ("/tmp/w/g", 0o600)


@pytest.mark.timeout(900)
def test_a_vm_polls_its_watch_and_keeps_no_metadata(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    vm = _box("microvm", daemon)
    try:
        vm.files.make_dir("/tmp/w")
        handle = vm.files.watch_dir("/tmp/w")
        vm.files.write("/tmp/w/a.txt", "a")
        assert ("create", "a.txt") in [(e.type.value, e.name) for e in handle.get_new_events()]
        handle.stop()
        with pytest.raises(InvalidArgumentException, match="metadata"):
            vm.files.write("/tmp/w/m.txt", "m", metadata={"k": "v"})
        assert not vm.files.exists("/tmp/w/m.txt")
    finally:
        vm.kill()
