"""pack_diff end to end: a sandbox's changes become an image that new sandboxes (here or on another node) start from."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dsec

from .conftest import IMAGES_DIR, Daemon, layer_bytes, shut_down, start_daemon

REPO = IMAGES_DIR / "repository"


def unique(prefix: str) -> str:
    return f"test/{prefix}:{secrets.token_hex(4)}"


CHANGES = r"""
set -e
mkdir -p /work/dir/sub /work/moved_from
echo hello > /work/file
chmod 4755 /work/file
ln /work/file /work/hard
ln -s file /work/link
ln -s /etc/passwd /work/abs-link
echo owned > /work/owned && chown 1234:4321 /work/owned && chmod 0640 /work/owned
chmod 0700 /work/dir
truncate -s 256M /work/sparse && printf tail >> /work/sparse
echo inside > /work/moved_from/x && mv /work/moved_from /work/moved_to
mv /etc/hostname /etc/hostname.renamed
rm /bin/vi
rm -r /usr/sbin
mkdir /usr/sbin && echo fresh > /usr/sbin/only
echo secret-history > /root/.bash_history
echo scratch > /tmp/scratch
mkdir -p /root/.ssh && echo KEY > /root/.ssh/id_ed25519 && echo host > /root/.ssh/config
mkdir -p /work/answers && echo the-answer-is-42 > /work/answers/key.txt
"""

CHECK = r"""
cd /work
stat -c '%n %a %u:%g %h %F' file hard owned dir moved_to moved_to/x
readlink link
readlink abs-link
stat -c '%s %b' sparse
tail -c 4 sparse; echo
cat /etc/hostname.renamed
for p in /etc/hostname /bin/vi /usr/sbin/ifconfig /root/.bash_history /tmp/scratch /root/.ssh/id_ed25519 \
         /work/answers/key.txt; do
  [ -e "$p" ] && echo "PRESENT $p"
done
ls /usr/sbin
cat /root/.ssh/config
"""


def test_snapshot_round_trip_reproduces_the_changes(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    sb = make_sandbox()
    assert sb.exec(CHANGES).exit_code == 0
    name = unique("roundtrip")
    info = sb.snapshot(name, scrub=["work/answers/*"])
    assert info.name == name and info.source_sandbox == sb.id
    assert [layer.role for layer in info.layers][-1] == "diff"
    parent = sb.info().image
    assert info.parent == daemon.client().image(parent).digest
    assert set(info.scrubbed) >= {"root/.bash_history", "tmp/scratch", "root/.ssh/id_ed25519", "work/answers/key.txt"}
    diff = info.layers[-1]
    assert diff.size < 8 << 20, "a 256 MiB sparse file must stay sparse in the layer"
    # the sandbox runs on after the snapshot
    assert sb.exec("echo alive").stdout == "alive\n"

    child = make_sandbox(image=name)
    out = child.exec(CHECK)
    assert out.exit_code == 0, out
    lines = out.stdout.splitlines()
    assert lines[0] == "file 4755 0:0 2 regular file"
    assert lines[1] == "hard 4755 0:0 2 regular file"
    assert lines[2] == "owned 640 1234:4321 1 regular file"
    assert lines[3].startswith("dir 700 0:0")
    assert lines[4].startswith("moved_to 755") and lines[5].startswith("moved_to/x 644")
    assert lines[6:8] == ["file", "/etc/passwd"]
    assert lines[8].split()[0] == str((256 << 20) + 4)
    assert lines[9] == "tail"
    assert lines[10] == "sandbox"
    assert not [line for line in lines if line.startswith("PRESENT")], out.stdout
    assert "only" in lines and "host" in lines
    # scrubbed bytes are not anywhere in the packed layer
    blob = layer_bytes(diff.digest)
    for secret in (b"secret-history", b"scratch\n", b"KEY\n", b"the-answer-is-42"):
        assert secret not in blob


def test_snapshot_of_a_snapshot_records_lineage(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    first = make_sandbox()
    first.exec("echo 1 > /gen && mkdir /opq && touch /opq/a /opq/b")
    a = first.snapshot(unique("gen1"))
    second = make_sandbox(image=a.name)
    assert second.exec("cat /gen").stdout == "1\n"
    # a directory removed and made again hides everything the lower layers had in it (opaque)
    second.exec("echo 2 > /gen && rm -r /opq && mkdir /opq && touch /opq/c")
    b = second.snapshot(unique("gen2"))
    assert b.parent == a.digest and len(b.layers) == len(a.layers) + 1
    history = daemon.client().image_history(b.name)
    assert [h.digest for h in history[:2]] == [b.digest, a.digest]
    assert make_sandbox(image=b.name).exec("cat /gen; ls /opq").stdout == "2\nc\n"


def test_snapshot_errors(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    taken = unique("taken")
    sb.snapshot(taken)
    with pytest.raises(dsec.ImageExists, match="immutable"):
        sb.snapshot(taken)
    with pytest.raises(dsec.InvalidRequest, match="invalid image name"):
        sb.snapshot("Not A Name")
    with pytest.raises(dsec.InvalidRequest, match="scrub rule"):
        sb.snapshot(unique("badrule"), scrub=["/absolute"])
    sb.kill()
    with pytest.raises(dsec.SandboxGone):
        sb.snapshot(unique("dead"))


def test_writes_wait_for_the_pack_and_land_after_it(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    sb.exec("dd if=/dev/urandom of=/big bs=1M count=48 2>/dev/null")
    errors: list[BaseException] = []

    def write_during() -> None:
        try:
            time.sleep(0.02)
            sb.files.write("/late.txt", b"late")
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=write_during)
    t.start()
    info = sb.snapshot(unique("during"))
    t.join()
    assert not errors
    assert sb.files.read("/late.txt") == b"late"
    assert info.layers[-1].size > 48 << 20


@pytest.fixture
def second_node() -> Iterator[Daemon]:
    """Another node on the same layer repository, with an empty cache."""
    d = start_daemon(Path(tempfile.mkdtemp(prefix="dsec-node2-")))
    try:
        yield d
    finally:
        shut_down(d)
        shutil.rmtree(d.state_dir, ignore_errors=True)


def test_another_node_starts_lazily_and_fetches_only_what_is_read(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    sb = make_sandbox()
    sb.exec("mkdir /data && dd if=/dev/urandom of=/data/big bs=1M count=64 2>/dev/null && echo small > /data/small")
    name = unique("lazy")
    sb.snapshot(name)
    client = second_node.client()
    with dsec.Sandbox.create(image=name, client=client) as remote:
        assert remote.exec("cat /data/small").stdout == "small\n"
        stats = client.image_stats(name)
        assert stats.mode == "lazy"
        assert stats.size > 64 << 20
        assert 0 < stats.fetched_bytes < stats.size * 0.15, stats
        # reading everything fetches the rest, and the bytes are the bytes that were written
        local = sb.exec("md5sum /data/big").stdout.split()[0]
        assert remote.exec("md5sum /data/big").stdout.split()[0] == local
        assert client.image_stats(name).fetched_bytes > 64 << 20


@pytest.mark.timeout(240)
def test_a_layer_read_whole_switches_to_its_local_copy_under_a_running_sandbox(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    sb = make_sandbox()
    sb.exec("mkdir /data && dd if=/dev/urandom of=/data/big bs=1M count=16 2>/dev/null")
    expected = sb.exec("md5sum /data/big").stdout.split()[0]
    info = sb.snapshot(unique("complete"))
    digest = info.layers[-1].digest
    images = second_node.state_dir / "images"
    mountpoint, local = images / "mnt" / digest, images / "blobs" / digest
    client = second_node.client()
    with dsec.Sandbox.create(image=info.name, client=client) as running:
        assert _mount_source(mountpoint) == str(images / "fetcher" / "mnt" / digest)
        for path in sorted(p for p in mountpoint.rglob("*") if p.is_file() and not p.is_symlink()):
            path.read_bytes()  # every chunk of the snapshot's layer fetched
        deadline = time.monotonic() + 60
        while not local.exists():
            assert time.monotonic() < deadline, "the fetcher wrote no local file of the complete layer"
            time.sleep(0.1)
        with dsec.Sandbox.create(image=info.name, client=client) as fresh:  # switches the node's mount
            while _mount_source(mountpoint) != str(local):
                assert time.monotonic() < deadline, f"the mount did not switch: {_mount_source(mountpoint)}"
                time.sleep(0.1)
            assert fresh.exec("md5sum /data/big").stdout.split()[0] == expected
        with dsec.Sandbox.create(image=info.name, client=client) as after:  # built on the local mount
            assert after.exec("md5sum /data/big").stdout.split()[0] == expected
        # the sandbox built on the lazy mount before the switch reads on
        assert running.exec("md5sum /data/big").stdout.split()[0] == expected


def _mount_source(mountpoint: Path) -> str | None:
    """The source of the topmost mount at ``mountpoint`` (the one no other mount there sits on)."""
    here: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if fields[4] == str(mountpoint):
                here[fields[0]] = (fields[1], right.split()[1])
    parents = {parent for parent, _ in here.values()}
    return next((source for mid, (_, source) in here.items() if mid not in parents), None)


def test_image_rm_and_gc(make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon) -> None:
    client = daemon.client()
    sb = make_sandbox()
    sb.exec("head -c 3000000 /dev/urandom > /payload")
    doomed = sb.snapshot(unique("doomed"))
    user = make_sandbox(image=doomed.name)
    with pytest.raises(dsec.ImageInUse):
        client.remove_image(doomed.name)
    user.kill()
    client.remove_image(doomed.name)
    with pytest.raises(dsec.ImageNotFound):
        client.image(doomed.name)
    result = client.gc_images()
    assert result.layers_deleted >= 1 and result.chunks_deleted >= 1
    # what is still named survives, and still starts
    assert make_sandbox().exec("echo ok").stdout == "ok\n"


def _image_with_big_file(
    make_sandbox: Callable[..., dsec.Sandbox], prefix: str
) -> tuple[dsec.ImageInfo, str, list[Path]]:
    sb = make_sandbox()
    sb.exec("mkdir /data && dd if=/dev/urandom of=/data/big bs=1M count=8 2>/dev/null")
    expected = sb.exec("md5sum /data/big").stdout.split()[0]
    info = sb.snapshot(unique(prefix))
    manifest = json.loads((REPO / "layers" / f"{info.layers[-1].digest}.json").read_text())
    return info, expected, [REPO / "chunks" / c[:2] / c for c in manifest["chunks"]]


def test_a_store_that_fails_is_an_io_error_in_the_sandbox_until_it_returns(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    info, expected, chunk_files = _image_with_big_file(make_sandbox, "faulty")
    with dsec.Sandbox.create(image=info.name, client=second_node.client()) as remote:
        hidden = [p.rename(p.with_name(p.name + ".away")) for p in chunk_files]
        try:
            res = remote.exec("md5sum /data/big", timeout=60)
            assert res.exit_code != 0 and "Input/output error" in res.stderr, res  # an error, never zeros
        finally:
            for moved in hidden:
                moved.rename(moved.with_name(moved.name.removesuffix(".away")))
        assert remote.exec("md5sum /data/big").stdout.split()[0] == expected  # the store is back


def test_a_corrupted_chunk_is_refused_in_the_sandbox(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    info, expected, chunk_files = _image_with_big_file(make_sandbox, "corrupt")
    victim = chunk_files[len(chunk_files) // 2]
    original = victim.read_bytes()
    with dsec.Sandbox.create(image=info.name, client=second_node.client()) as remote:
        try:
            victim.write_bytes(b"\0" * len(original))
            res = remote.exec("md5sum /data/big", timeout=60)
            assert res.exit_code != 0 and "Input/output error" in res.stderr, res
        finally:
            victim.write_bytes(original)
        assert remote.exec("md5sum /data/big").stdout.split()[0] == expected


def test_sandboxes_cold_starting_together_share_each_fetch(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    sb = make_sandbox()
    sb.exec("mkdir /data && dd if=/dev/urandom of=/data/big bs=1M count=24 2>/dev/null")
    info = sb.snapshot(unique("shared"))
    client = second_node.client()
    boxes = [dsec.Sandbox.create(image=info.name, client=client) for _ in range(4)]
    try:
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda b=b: results.append(b.exec("md5sum /data/big").stdout)) for b in boxes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(results)) == 1 and len(results) == 4
        layer = next(x for x in client.image_stats(info.name).layers if x.digest == info.layers[-1].digest)
        assert layer.fetched_bytes <= layer.size  # each chunk fetched once, however many readers waited
        assert layer.read_bytes >= 24 << 20
    finally:
        for b in boxes:
            b.kill()


def test_a_fetcher_killed_under_a_running_daemon_is_replaced(
    make_sandbox: Callable[..., dsec.Sandbox], second_node: Daemon
) -> None:
    info, expected, _ = _image_with_big_file(make_sandbox, "refetch")
    client = second_node.client()
    with dsec.Sandbox.create(image=info.name, client=client) as first:
        assert first.exec("echo up").stdout == "up\n"
        pid_file = second_node.state_dir / "images" / "fetcher" / "fetcher.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        broken = first.exec("md5sum /data/big", timeout=60)
        assert broken.exit_code != 0 and expected not in broken.stdout  # an error, never zeros passed off as data
        with dsec.Sandbox.create(image=info.name, client=client) as second:
            assert second.exec("md5sum /data/big").stdout.split()[0] == expected
