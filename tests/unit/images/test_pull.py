"""ImageStore.pull against an in-process fake registry (httpx.MockTransport), and the parts of a pull that
need no registry: the layer records and their gc, version digests, the progress and its callback, the
bridge between the download and the extracting thread, the node's registry options. The same pulls against
a real Distribution registry: tests/integration/test_registry_pull*.py."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from dsec.errors import BackendError, ImageExists, InvalidRequest, StorageFull
from dsec.images.model import (
    DEFAULT_PATH,
    REGISTRY_LAYERS,
    ImageConfig,
    ImageSource,
    ImageVersion,
    LayerRef,
    RegistryLayer,
    registry_layer_key,
)
from dsec.images.pull import scrub_fingerprint
from dsec.images.pull_progress import LayerProgress, PullProgress, PullReporter
from dsec.images.pull_stream import ByteBridge
from dsec.images.registry import RegistryOptions, RetryPolicy
from dsec.images.scrub import ScrubRules
from dsec.images.store import ImageStore
from dsec.protocol.build import LayerRole

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="extraction needs root: chown, mknod whiteouts")
HOST = "registry.test"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_gz(files: dict[str, bytes]) -> tuple[bytes, bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0), buf.getvalue()


class Body(httpx.AsyncByteStream):
    """A blob as a registry streams it, in pieces; ``stall`` stops it half-way until the test ends."""

    def __init__(self, data: bytes, stall: asyncio.Event | None = None) -> None:
        self.data = data
        self.stall = stall

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), 4096):
            if self.stall is not None and i >= len(self.data) // 2:
                await self.stall.wait()
            yield self.data[i : i + 4096]


@dataclass
class Fake:
    """A registry answering /v2/ manifests and blobs, recording every request."""

    manifests: dict[tuple[str, str], bytes] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    stall: asyncio.Event | None = None

    def image(
        self, repo: str, tag: str, layers: list[tuple[bytes, bytes]], *, diff_ids: list[str] | None = None
    ) -> str:
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": ["PATH=/bin", "A=b=c"], "Entrypoint": ["/bin/run"], "Cmd": ["x"], "User": "agent"},
                "rootfs": {"type": "layers", "diff_ids": diff_ids or [sha(tar) for _, tar in layers]},
            }
        ).encode()
        for blob in (config, *(b for b, _ in layers)):
            self.blobs[sha(blob)] = blob
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": sha(config),
                    "size": len(config),
                },
                "layers": [
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(b), "size": len(b)}
                    for b, _ in layers
                ],
            }
        ).encode()
        self.manifests[(repo, tag)] = self.manifests[(repo, sha(manifest))] = manifest
        return sha(manifest)

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        m = re.fullmatch(r"/v2/(.+)/(manifests|blobs)/([^/]+)", request.url.path)
        if m is None:
            return httpx.Response(200 if request.url.path == "/v2/" else 404)
        if m[2] == "manifests":
            doc = self.manifests.get((m[1], m[3]))
            if doc is None:
                return httpx.Response(404, json={"errors": [{"code": "MANIFEST_UNKNOWN"}]})
            headers = {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": sha(doc)}
            return httpx.Response(200, content=doc, headers=headers)
        blob = self.blobs.get(m[3])
        if blob is None:
            return httpx.Response(404, json={"errors": [{"code": "BLOB_UNKNOWN"}]})
        return httpx.Response(200, headers={"Content-Length": str(len(blob))}, stream=Body(blob, self.stall))

    def count(self, what: str) -> int:
        return sum(1 for r in self.requests if what in r)


def store_for(root: Path, fake: Fake, **options: object) -> ImageStore:
    given: dict[str, object] = {
        "use_docker_config": False,
        "retry": RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02),
        "transport": httpx.MockTransport(fake.handler),
        **options,
    }
    return ImageStore(root, lazy=False, mount=False, registry=RegistryOptions(**given))  # type: ignore[arg-type]


async def keys(store: ImageStore) -> list[str]:
    return await store.catalog.repo.list("")


@needs_root
async def test_shared_layers_convert_once_and_the_policies(tmp_path: Path) -> None:
    fake = Fake()
    base, one, two = tar_gz({"etc/base": b"base"}), tar_gz({"task": b"1"}), tar_gz({"task": b"2"})
    fake.image("org/a", "1", [base, one])
    fake.image("org/b", "1", [base, two])
    store = store_for(tmp_path, fake)
    a, b = await asyncio.gather(store.pull(f"{HOST}/org/a:1"), store.pull(f"{HOST}/org/b:1"))
    assert fake.count(f"/blobs/{sha(base[0])}") == 1  # one conversion, awaited by both pulls
    assert a.layers[0].digest == b.layers[0].digest and len(await store.catalog.repo.list(REGISTRY_LAYERS)) == 3
    version = await store.catalog.version(a.digest or "")
    assert version.config.env == {"PATH": "/bin", "A": "b=c"} and version.config.user == "agent"
    assert (version.config.entrypoint, version.config.cmd) == (["/bin/run"], ["x"])

    seen = len(fake.requests)
    assert (await store.pull(f"{HOST}/org/a:1")).digest == a.digest
    assert len(fake.requests) == seen  # if-not-present: the registry is not asked
    assert (await store.pull(f"{HOST}/org/a:1", policy="always")).digest == a.digest
    assert [r for r in fake.requests[seen:] if "/v2/org" in r] == ["GET /v2/org/a/manifests/1"]

    fake.image("org/a", "1", [base, tar_gz({"task": b"1, fixed"})])  # the tag moves
    moved = await store.pull(f"{HOST}/org/a:1", policy="always")
    assert moved.digest != a.digest and moved.layers[0].digest == a.layers[0].digest
    assert (await store.resolve(f"{HOST}/org/a:1", build=False)).digest == moved.digest
    with pytest.raises(InvalidRequest, match="pull policy 'never'"):
        await store.pull(f"{HOST}/org/a:1", policy="never")  # type: ignore[arg-type]


@needs_root
async def test_a_layer_twice_in_one_image_is_fetched_once(tmp_path: Path) -> None:
    fake = Fake()
    empty = tar_gz({})  # real images repeat the empty layer
    fake.image("org/twice", "1", [empty, tar_gz({"f": b"x"}), empty])
    info = await store_for(tmp_path, fake).pull(f"{HOST}/org/twice:1")
    assert fake.count(f"/blobs/{sha(empty[0])}") == 1
    assert len(info.layers) == 3 and info.layers[0].digest == info.layers[2].digest


@needs_root
async def test_a_wrong_diff_id_leaves_nothing(tmp_path: Path) -> None:
    fake = Fake()
    layer = tar_gz({"f": b"x"})
    fake.image("org/bad", "1", [layer], diff_ids=[sha(b"something else")])
    store = store_for(tmp_path, fake)
    before = await keys(store)
    with pytest.raises(InvalidRequest, match="does not match diff_id"):
        await store.pull(f"{HOST}/org/bad:1")
    assert await keys(store) == before and os.listdir(store.layers.tmp) == []
    assert store.pulling(f"{HOST}/org/bad:1") is None


@needs_root
async def test_a_full_repository_leaves_no_layer_record_or_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake()
    fake.image("org/big", "1", [tar_gz({"a": os.urandom(3 << 20)})])
    store = store_for(tmp_path, fake)
    put = store.catalog.repo.put
    stored: list[str] = []

    async def full_after_two(key: str, data: bytes) -> None:
        if len(stored) >= 2:
            raise StorageFull(f"no space left in the repository for {key}")
        stored.append(key)
        await put(key, data)

    monkeypatch.setattr(store.catalog.repo, "put", full_after_two)
    with pytest.raises(StorageFull):
        await store.pull(f"{HOST}/org/big:1")
    # the two chunks that went in are pieces any layer may share: gc takes them once nothing holds them
    assert all(k.startswith("chunks/") for k in stored) and [k for k in await keys(store) if "chunks/" not in k] == []
    assert os.listdir(store.layers.tmp) == [] and os.listdir(store.layers.blobs) == []


@needs_root
async def test_closing_the_store_cancels_a_conversion_cleanly(tmp_path: Path) -> None:
    fake = Fake(stall=asyncio.Event())
    fake.image("org/slow", "1", [tar_gz({"a": os.urandom(1 << 20)})])
    store = store_for(tmp_path, fake)
    name = f"{HOST}/org/slow:1"
    pull = asyncio.ensure_future(store.pull(name))
    for _ in range(200):
        now = store.pulling(name)
        if now is not None and now.layers and now.layers[0].phase == "fetching":
            break
        await asyncio.sleep(0.01)
    before = [k for k in await keys(store) if not k.startswith("chunks/")]
    await store.close(0)
    with pytest.raises(BackendError, match="the node's image store is closing"):
        await pull
    assert os.listdir(store.layers.tmp) == [] and await store.catalog.tags() == [] and before == []
    assert [k for k in await keys(store) if not k.startswith("chunks/")] == []
    fake.stall.set()


@needs_root
async def test_a_record_whose_layer_was_collected_is_converted_again(tmp_path: Path) -> None:
    fake = Fake()
    layer = tar_gz({"f": b"x"})
    fake.image("org/a", "1", [layer])
    store = store_for(tmp_path, fake)
    first = await store.pull(f"{HOST}/org/a:1")
    await store.remove(f"{HOST}/org/a:1", in_use=set())
    report = await store.gc(set())
    assert report.layers_deleted == 1 and await store.catalog.repo.list(REGISTRY_LAYERS) == []  # gc forgot it
    again = await store.pull(f"{HOST}/org/a:1")
    assert fake.count(f"/blobs/{sha(layer[0])}") == 2 and again.layers[0].digest != first.layers[0].digest


@needs_root
async def test_a_progress_callback_that_raises_does_not_fail_the_pull(tmp_path: Path) -> None:
    fake = Fake()
    fake.image("org/a", "1", [tar_gz({"f": b"x"})])
    calls: list[str] = []

    def broken(p: PullProgress) -> None:
        calls.append(p.phase)
        raise RuntimeError("a bug in the caller")

    info = await store_for(tmp_path, fake).pull(f"{HOST}/org/a:1", progress=broken)
    assert info.layers and calls == ["resolving"]  # called once, then no more


async def test_a_local_name_is_not_replaced_nor_given_to_another_tenant(tmp_path: Path) -> None:
    fake = Fake()
    store = store_for(tmp_path, fake)
    local = ImageVersion(name=f"{HOST}/org/local:1", layers=[])
    async with store.catalog.publishing():
        await store.catalog.publish(local, owner="alice")  # a snapshot named like a registry reference
    with pytest.raises(ImageExists, match="was not pulled from a registry"):
        await store.pull(f"{HOST}/org/local:1", policy="always")
    with pytest.raises(ImageExists, match="was not pulled from a registry"):
        await store.pull(f"{HOST}/org/local:1", owner="bob")
    mine = await store.pull(f"{HOST}/org/local:1", owner="alice")  # present: hers, used as it is
    assert (mine.digest, mine.owner) == (local.digest, "alice") and fake.requests == []


# ---- records, versions, moves -------------------------------------------------------------------------------


def test_a_version_without_source_keeps_its_digest() -> None:
    version = ImageVersion(name="a:1", layers=[LayerRef(digest="0" * 64, role=LayerRole.base, size=1)])
    assert b'"source":' not in version.canonical()
    pulled = version.model_copy(update={"source": ImageSource(reference="h/a:1", digest="d", manifest="m")})
    assert b'"source":{' in pulled.canonical() and pulled.digest != version.digest
    assert ImageVersion.model_validate_json(pulled.canonical()).digest == pulled.digest


def test_a_version_stored_before_cmd_labels_and_ports_keeps_its_digest() -> None:
    """A version as an older dsec stored it (no cmd, labels or exposed ports in its config) hashes to the
    name it was stored under; one that sets them hashes them."""
    version = ImageVersion(
        name="a:1",
        layers=[LayerRef(digest="0" * 64, role=LayerRole.base, size=1)],
        config=ImageConfig(entrypoint=["/bin/sh"]),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    older = {"env": {"PATH": DEFAULT_PATH}, "workdir": "/", "user": "root", "entrypoint": ["/bin/sh"]}
    stored = json.loads(version.canonical())
    assert stored["config"] == older
    assert ImageVersion.model_validate(stored).digest == version.digest
    labelled = version.model_copy(
        update={"config": ImageConfig(cmd=["x"], labels={"k": "v"}, exposed_ports=["80/tcp"])}
    )
    assert json.loads(labelled.canonical())["config"]["labels"] == {"k": "v"} and labelled.digest != version.digest


async def test_publish_moves_a_name_only_when_asked(tmp_path: Path) -> None:
    store = ImageStore(tmp_path, lazy=False, mount=False)
    one, two = ImageVersion(name="x/y:1", layers=[], description="1"), ImageVersion(name="x/y:1", layers=[])
    async with store.catalog.publishing():
        await store.catalog.publish(one)
        with pytest.raises(ImageExists):
            await store.catalog.publish(two)
        assert await store.catalog.publish(two, move=True) == two.digest
    tag = await store.catalog.tag("x/y:1")
    assert tag is not None and tag.digest == two.digest


def test_scrub_fingerprints_and_record_keys() -> None:
    default, extra = ScrubRules(), ScrubRules.of(["work/answers/*"])
    assert scrub_fingerprint(default) == scrub_fingerprint(ScrubRules(tuple(reversed(default.patterns))))
    assert scrub_fingerprint(default) != scrub_fingerprint(extra)
    key = registry_layer_key("sha256:" + "a" * 64, scrub_fingerprint(default))
    assert re.fullmatch(rf"{REGISTRY_LAYERS}a{{64}}-[0-9a-f]{{16}}\.json", key)
    RegistryLayer(digest="sha256:" + "a" * 64, size=1, layer="b" * 64, layer_size=2, scrub="f")
    with pytest.raises(ValueError):
        RegistryLayer(digest="sha512:" + "a" * 64, size=1, layer="b" * 64, layer_size=2, scrub="f")


# ---- options -----------------------------------------------------------------------------------------------


def test_registry_options(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="parallel layers must be 1 to 16"):
        RegistryOptions(parallel_layers=0)
    with pytest.raises(InvalidRequest, match="invalid registry mirror"):
        RegistryOptions(mirrors=("no-equals-sign",))
    with pytest.raises(InvalidRequest, match="is plain HTTP"):
        RegistryOptions(mirrors=("docker.io=http://mirror.example",))
    with pytest.raises(InvalidRequest, match="is not a readable file"):
        RegistryOptions(ca_files={"r.example": tmp_path / "missing.pem"})
    with pytest.raises(InvalidRequest, match="user:password"):
        RegistryOptions(credentials={"r.example": "no-colon"})
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"auths": {"a.example": {"username": "u", "password": "p"}, "b.example": {"auth": "eDp5"}}})
    )
    opts = RegistryOptions(credentials={"b.example": "mine:secret"}, docker_config=config)
    creds = opts.credential_store()
    assert creds.lookup("a.example") is not None and creds.lookup("a.example").username == "u"  # type: ignore[union-attr]
    assert creds.lookup("b.example").username == "mine"  # type: ignore[union-attr]  # the explicit ones win
    assert RegistryOptions(docker_config=config, use_docker_config=False).credential_store().lookup("a.example") is None
    # a malformed config.json fails the first pull that reads it, not the options (the daemon's start)
    config.write_text("{not json")
    broken = RegistryOptions(docker_config=config)
    with pytest.raises(InvalidRequest, match="cannot read Docker config"):
        broken.client()


# ---- progress --------------------------------------------------------------------------------------------


def test_progress_counts_and_what_it_waits_for() -> None:
    p = PullProgress(reference="h/a:1", phase="layers")
    p.layers = [
        LayerProgress("sha256:" + "1" * 64, 100, "reused"),
        LayerProgress("sha256:" + "2" * 64, 1_000_000, "fetching", fetched=400_000),
        LayerProgress("sha256:" + "3" * 64, 2_000_000, "done", fetched=2_000_000, shared=True),
    ]
    assert (p.layers_total, p.layers_done, p.layers_reused) == (3, 2, 1)
    assert (p.bytes_fetched, p.bytes_total) == (2_400_000, 3_000_000)
    assert p.waiting_for() == (
        "pulling h/a:1: 2/3 layers ready (1 reused), 2.4 MB of 3.0 MB fetched; 222222222222 fetching"
    )
    assert PullProgress(reference="h/a:1").waiting_for() == "pulling h/a:1: resolving its manifest"
    snap = p.snapshot()
    snap.layers[1].fetched = 0
    assert p.layers[1].fetched == 400_000  # a snapshot is a copy


def test_byte_reports_are_spaced_and_phases_always_go() -> None:
    got: list[int] = []
    reporter = PullReporter(PullProgress(reference="h/a:1"), lambda p: got.append(p.bytes_fetched))
    reporter.phase()
    for _ in range(100):
        reporter.bytes()  # within MIN_INTERVAL of the phase report: dropped
    reporter.phase()
    assert len(got) == 2


# ---- the bridge between the download and the extracting thread ---------------------------------------------


async def test_the_bridge_hands_bytes_over_bounded() -> None:
    bridge = ByteBridge(asyncio.get_running_loop(), limit=10)
    out: list[bytes] = []

    def reader() -> None:
        while chunk := bridge.read(3):
            out.append(chunk)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(50):
        assert await bridge.put(bytes([i]) * 7)
    bridge.finish()
    await asyncio.to_thread(thread.join)
    assert b"".join(out) == b"".join(bytes([i]) * 7 for i in range(50)) and max(map(len, out)) <= 3


async def test_either_side_stopping_stops_the_other() -> None:
    bridge = ByteBridge(asyncio.get_running_loop(), limit=4)
    failed: list[BaseException] = []

    def reader() -> None:
        try:
            bridge.read()
        except Exception as e:
            failed.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    await asyncio.sleep(0.01)
    bridge.abort()  # the download failed: the reader waiting for bytes raises
    await asyncio.to_thread(thread.join)
    assert failed and "the download stopped" in str(failed[0])

    bridge = ByteBridge(asyncio.get_running_loop(), limit=4)
    assert await bridge.put(b"12345")
    waiting = asyncio.ensure_future(bridge.put(b"more"))  # over the limit: waits for the reader
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await asyncio.to_thread(bridge.reader_gone)  # the extraction ended (a hostile member, say)
    assert await asyncio.wait_for(waiting, 1) is False


# ---- publishes and gc --------------------------------------------------------------------------------------


async def test_a_gc_waiting_for_a_publish_never_deadlocks_with_later_ones(tmp_path: Path) -> None:
    catalog = ImageStore(tmp_path, lazy=False, mount=False).catalog
    order: list[str] = []
    release = asyncio.Event()

    async def outer() -> None:
        async with catalog.publishing():
            order.append("outer in")
            await release.wait()

            async def nested() -> None:  # a layer conversion the outer publish waits for
                async with catalog.publishing():
                    order.append("nested in")

            await asyncio.ensure_future(nested())
        order.append("outer out")

    async def independent() -> None:
        async with catalog.publishing():
            order.append("independent in")

    first = asyncio.ensure_future(outer())
    await asyncio.sleep(0)
    gc = asyncio.ensure_future(catalog.gc(set(), set()))
    await asyncio.sleep(0.01)  # the gc holds its lock and waits for the outer publish
    later = asyncio.ensure_future(independent())
    await asyncio.sleep(0.01)
    assert not gc.done() and "independent in" not in order  # it waits for the gc, uncounted
    release.set()
    await asyncio.wait_for(asyncio.gather(first, gc, later), 5)
    assert order == ["outer in", "nested in", "outer out", "independent in"]
