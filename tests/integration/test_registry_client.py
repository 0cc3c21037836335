"""The registry client against real Distribution registries (Debian's docker-registry) started here on
loopback: plain HTTP and anonymous; TLS with a CA made here and htpasswd auth; token auth with a token
service run here. Images are OCI layouts written by the test and pushed with skopeo (tests/integration/
registry.py): two images sharing layers (a plain tar and a gzip one), a two-platform index, a Docker schema 2
copy, a 48 MiB layer for the registry to die in the middle of."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.errors import DigestMismatch, ImageNotFound, RegistryAuthFailed, RegistryUnreachable
from dsec.images.registry import (
    CredentialStore,
    Descriptor,
    Platform,
    RegistryClient,
    RegistryHosts,
    RetryPolicy,
    parse_reference,
)
from dsec.images.registry.manifest import DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST

from .registry import Layer, OciLayout, Registry, TokenService, htpasswd, layer, make_tls, push, start_registry

FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2)
BIG = 48 << 20


@dataclass
class Images:
    layout: OciLayout
    base: Layer  # a plain tar, in v1 and v2
    lib: Layer  # tar+gzip, in v1 and v2
    extra: Layer  # only in v2
    big: Layer
    victim: Layer  # only in the image whose storage the tests damage
    v1: dict[str, object]
    v2: dict[str, object]
    arm: dict[str, object]
    multi: dict[str, object]


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name (conftest.py), which starts a dsec daemon: nothing here
    needs one."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-registry-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def images(workdir: Path) -> Images:
    layout = OciLayout(workdir / "layout")
    base = layer({"etc/os-release": b"ID=dsec-test\n", "bin/tool": b"\x7fELF" + bytes(5000)}, gzipped=False)
    lib = layer({"usr/lib/libx.so": os.urandom(20_000) + bytes(50_000)}, gzipped=True)
    extra = layer({"work/task.txt": b"task two\n"}, gzipped=True)
    # incompressible and stored (gzip level 0): big on the wire, cheap to make, and skopeo keeps it as is
    big = layer({"data/blob.bin": os.urandom(BIG)}, gzipped=True, level=0)
    victim = layer({"victim.txt": b"to be damaged in the registry's storage\n" * 100}, gzipped=True)
    v1 = layout.image([base, lib])
    v2 = layout.image([base, lib, extra])
    arm = layout.image([layer({"etc/arm": b"arm64\n"}, gzipped=True)], architecture="arm64")
    multi = layout.index([v1, arm])
    for desc, name in ((v1, "v1"), (v2, "v2"), (multi, "multi"), (layout.image([big]), "big")):
        layout.name(desc, name)
    layout.name(layout.image([victim]), "victim")
    return Images(layout, base, lib, extra, big, victim, v1, v2, arm, multi)


@pytest.fixture(scope="module")
def plain(workdir: Path, images: Images) -> Iterator[Registry]:
    registry = start_registry(workdir / "plain")
    try:
        for ref, repository in (("v1", "app:v1"), ("v2", "app:v2"), ("victim", "victim:1"), ("v1", "private/app:v1")):
            push(images.layout, ref, registry, repository)
        push(images.layout, "multi", registry, "app:multi", multi=True)
        push(images.layout, "v1", registry, "docker/app:v1", docker_format=True)
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def tls_registry(workdir: Path, images: Images) -> Iterator[Registry]:
    tls = make_tls(workdir / "tls")
    users = htpasswd(workdir, {"alice": "correct horse"})
    registry = start_registry(
        workdir / "tls-registry", tls=tls, auth={"htpasswd": {"realm": "dsec-test", "path": str(users)}}
    )
    try:
        push(images.layout, "v1", registry, "private/app:v1", creds="alice:correct horse")
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def token_registry(workdir: Path, images: Images) -> Iterator[tuple[Registry, TokenService]]:
    tokens = TokenService(workdir / "token", users={"bob": "hunter2"})
    auth = {
        "token": {
            "realm": tokens.realm,
            "service": tokens.service,
            "issuer": tokens.issuer,
            "rootcertbundle": str(tokens.cert),
        }
    }
    registry = start_registry(workdir / "token-registry", auth=auth)
    try:
        for ref, repository in (("v1", "private/app:v1"), ("v2", "private/app:v2"), ("v1", "public/app:v1")):
            push(images.layout, ref, registry, repository, creds="bob:hunter2")
        yield registry, tokens
    finally:
        registry.stop()
        tokens.stop()


@pytest.fixture(scope="module")
def flaky(workdir: Path, images: Images) -> Iterator[Registry]:
    """A registry of its own, for the tests that kill it."""
    registry = start_registry(workdir / "flaky")
    try:
        push(images.layout, "big", registry, "big:1")
        yield registry
    finally:
        registry.stop()


def _layers(desc: dict[str, object], images: Images) -> list[str]:
    data = (images.layout.directory / "blobs/sha256" / str(desc["digest"]).removeprefix("sha256:")).read_bytes()
    return [x["digest"] for x in json.loads(data)["layers"]]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _plain_tar(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


# ---- (a) plain HTTP, anonymous ----------------------------------------------------------------------------


async def test_manifest_by_tag_and_by_digest(plain: Registry, images: Images) -> None:
    async with RegistryClient(retry=FAST) as client:
        image = await client.resolve(parse_reference(f"{plain.host}/app:v1"))
        assert (image.digest, image.media_type, image.index_digest) == (images.v1["digest"], OCI_MANIFEST, None)
        assert [d.digest for d in image.manifest.layers] == [images.base.digest, images.lib.digest]
        assert image.config.rootfs is not None and image.config.rootfs.diff_ids == [
            images.base.diff_id,
            images.lib.diff_id,
        ]
        assert image.config.config is not None and image.config.config.working_dir == "/work"
        assert str(image.reference) == f"{plain.host}/app:v1@{images.v1['digest']}"
        for pinned in (f"{plain.host}/app@{images.v1['digest']}", f"{plain.host}/app:v1@{images.v1['digest']}"):
            assert (await client.resolve(parse_reference(pinned))).digest == images.v1["digest"]
        # the same image pushed as Docker schema 2: Docker media types, the same blobs
        docker = await client.resolve(parse_reference(f"{plain.host}/docker/app:v1"))
        assert docker.media_type == DOCKER_MANIFEST
        assert [d.digest for d in docker.manifest.layers] == [images.base.digest, images.lib.digest]
        assert docker.manifest.config.digest == image.manifest.config.digest


async def test_an_index_resolves_to_amd64_or_the_platform_asked(plain: Registry, images: Images) -> None:
    ref = parse_reference(f"{plain.host}/app:multi")
    async with RegistryClient(retry=FAST) as client:
        index = await client.fetch_manifest(ref)
        assert index.media_type == OCI_INDEX and index.digest == images.multi["digest"]
        assert index.document.index is not None and len(index.document.index.manifests) == 2
        amd64 = await client.resolve(ref)
        assert (amd64.index_digest, amd64.digest) == (images.multi["digest"], images.v1["digest"])
        arm64 = await client.resolve(ref, Platform.parse("linux/arm64"))
        assert arm64.digest == images.arm["digest"] and arm64.config.architecture == "arm64"


async def test_blobs_download_verified_and_tags_share_layers(plain: Registry, images: Images, tmp_path: Path) -> None:
    async with RegistryClient(retry=FAST) as client:
        v1 = await client.resolve(parse_reference(f"{plain.host}/app:v1"))
        v2 = await client.resolve(parse_reference(f"{plain.host}/app:v2"))
        assert v2.manifest.layers[:2] == v1.manifest.layers  # the second tag shares the first's layers
        assert [d.digest for d in v2.manifest.layers] == _layers(images.v2, images)
        for desc, expected in zip(v2.manifest.layers, (images.base, images.lib, images.extra), strict=True):
            done = await client.download_blob(v2.reference, desc, tmp_path / desc.digest)
            assert (done.size, done.resumes) == (len(expected.blob), 0)
            assert hashlib.sha256(done.path.read_bytes()).hexdigest() == desc.digest.removeprefix("sha256:")
            assert _plain_tar(done.path) == expected.tar
        streamed = b"".join([c async for c in client.blob_chunks(v1.reference, v1.manifest.layers[1])])
        assert streamed == images.lib.blob
    assert len(_names(tmp_path)) == 3  # nothing else: no temporary files left


async def test_missing_tags_repositories_and_digests_are_not_found(plain: Registry) -> None:
    async with RegistryClient(retry=FAST) as client:
        with pytest.raises(ImageNotFound, match="has no tag nope in repository app"):
            await client.resolve(parse_reference(f"{plain.host}/app:nope"))
        # Distribution says MANIFEST_UNKNOWN here, not NAME_UNKNOWN: the tag is what is missing
        with pytest.raises(ImageNotFound, match="has no tag v1 in repository nothing/here"):
            await client.resolve(parse_reference(f"{plain.host}/nothing/here:v1"))
        with pytest.raises(ImageNotFound, match="has no digest sha256:0000"):
            await client.resolve(parse_reference(f"{plain.host}/app:v1@sha256:{'0' * 64}"))


async def test_content_damaged_in_the_registry_is_refused(plain: Registry, images: Images, tmp_path: Path) -> None:
    ref = parse_reference(f"{plain.host}/victim:1")
    async with RegistryClient(retry=FAST) as client:
        image = await client.resolve(ref)
        (desc,) = image.manifest.layers
        stored = plain.blob_file(desc.digest)
        data = bytearray(stored.read_bytes())
        data[-20] ^= 0xFF  # same size, other bytes: only the digest can tell
        stored.write_bytes(bytes(data))
        with pytest.raises(DigestMismatch, match=f"blob {desc.digest} of {plain.host}/victim"):
            await client.download_blob(image.reference, desc, tmp_path / "victim")
        assert _names(tmp_path) == []
        # the manifest damaged the same way: the registry still names it by its old digest
        manifest = plain.blob_file(image.digest)
        text = manifest.read_bytes()
        manifest.write_bytes(text.replace(b'"schemaVersion": 2', b'"schemaVersion":\t2'))
        with pytest.raises(DigestMismatch, match="the registry says"):
            await client.fetch_manifest(ref)
        with pytest.raises(DigestMismatch, match=rf"not the {image.digest} it was asked for"):
            await client.fetch_manifest(ref.with_digest(image.digest))  # the pinned digest


# ---- (b) TLS with a CA of its own, htpasswd -------------------------------------------------------------


async def test_tls_with_the_hosts_ca_and_basic_auth(tls_registry: Registry, images: Images, tmp_path: Path) -> None:
    assert tls_registry.tls is not None
    host = tls_registry.host
    ref = parse_reference(f"{host}/private/app:v1")
    hosts = RegistryHosts.from_options(ca_files={host: tls_registry.tls.ca})
    config = tmp_path / "docker" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(b"alice:correct horse").decode()}}}))
    async with RegistryClient(
        hosts=hosts, credentials=CredentialStore.from_docker_config(config), retry=FAST
    ) as client:
        image = await client.resolve(ref)
        assert image.digest == images.v1["digest"]
        done = await client.download_blob(image.reference, image.manifest.layers[0], tmp_path / "base")
        assert _plain_tar(done.path) == images.base.tar

    wrong = CredentialStore.from_mapping({host: "alice:wrong"})
    async with RegistryClient(hosts=hosts, credentials=wrong, retry=FAST) as client:
        with pytest.raises(RegistryAuthFailed) as info:
            await client.resolve(ref)
    assert f"registry {host} refused access to private/app for user 'alice'" in str(info.value)
    assert "wrong" not in str(info.value)

    async with RegistryClient(hosts=hosts, retry=FAST) as client:
        with pytest.raises(RegistryAuthFailed, match=f"registry {host} requires credentials"):
            await client.resolve(ref)

    # without the CA: TLS fails verification (never skipped), and plain HTTP is answered by a TLS server
    async with RegistryClient(credentials=wrong, retry=FAST) as client:
        with pytest.raises(RegistryUnreachable) as unreachable:
            await client.resolve(ref)
    assert host in str(unreachable.value) and "CERTIFICATE_VERIFY_FAILED" in str(unreachable.value)


# ---- (c) token auth --------------------------------------------------------------------------------------


async def test_token_auth(token_registry: tuple[Registry, TokenService], images: Images, tmp_path: Path) -> None:
    registry, tokens = token_registry
    host = registry.host
    creds = CredentialStore.from_mapping({host: "bob:hunter2"})
    async with RegistryClient(credentials=creds, retry=FAST) as client:
        before = len(tokens.requests)
        image = await client.resolve(parse_reference(f"{host}/private/app:v2"))
        for desc in image.manifest.layers:
            await client.download_blob(image.reference, desc, tmp_path / desc.digest)
        assert image.digest == images.v2["digest"]
        # one token for the manifest, the config and every blob of the repository: cached per scope
        assert tokens.requests[before:] == [("bob", ["repository:private/app:pull"])]

    async with RegistryClient(retry=FAST) as client:
        public = await client.resolve(parse_reference(f"{host}/public/app:v1"))  # an anonymous token will do
        assert public.digest == images.v1["digest"] and tokens.requests[-1][0] == ""
        with pytest.raises(RegistryAuthFailed, match=f"registry {host} refused anonymous access to private/app"):
            await client.resolve(parse_reference(f"{host}/private/app:v1"))

    wrong = CredentialStore.from_mapping({host: "bob:wrong"})
    async with RegistryClient(credentials=wrong, retry=FAST) as client:
        with pytest.raises(RegistryAuthFailed) as info:
            await client.resolve(parse_reference(f"{host}/private/app:v1"))
    assert f"token service {tokens.realm} of registry {host} refused the credentials of user 'bob'" in str(info.value)


async def test_a_mirror_first_then_the_registry(
    plain: Registry, token_registry: tuple[Registry, TokenService], images: Images
) -> None:
    registry, tokens = token_registry
    hosts = RegistryHosts.from_options(mirrors=[f"{registry.host}=http://{plain.host}"])
    creds = CredentialStore.from_mapping({registry.host: "bob:hunter2"})
    async with RegistryClient(hosts=hosts, credentials=creds, retry=FAST) as client:
        before = len(tokens.requests)
        mirrored = await client.fetch_manifest(parse_reference(f"{registry.host}/private/app:v1"))
        assert mirrored.served_by.startswith(f"mirror http://{plain.host}") and len(tokens.requests) == before
        # not on the mirror: the registry itself answers
        image = await client.resolve(parse_reference(f"{registry.host}/private/app:v2"))
        assert image.digest == images.v2["digest"] and len(tokens.requests) > before


# ---- the registry dying in the middle of a blob ----------------------------------------------------------


async def test_a_blob_resumes_after_the_registry_dies_and_comes_back(
    flaky: Registry, images: Images, tmp_path: Path
) -> None:
    if flaky.proc is None or flaky.proc.poll() is not None:
        flaky.start()
    loop = asyncio.get_running_loop()
    killed: list[int] = []

    def progress(done: int, size: int) -> None:
        if not killed:
            killed.append(done)
            flaky.kill()  # what it had sent stays in the socket buffers: the rest breaks off
            loop.call_later(1.0, flaky.start)  # from this (the main) thread: see registry.py

    async with RegistryClient(retry=RetryPolicy(attempts=8, base_delay=0.2, max_delay=1.0)) as client:
        image = await client.resolve(parse_reference(f"{flaky.host}/big:1"))
        (desc,) = image.manifest.layers
        done = await client.download_blob(image.reference, desc, tmp_path / "big", progress=progress)
    assert killed and killed[0] < BIG
    assert done.resumes == 1 and done.size == len(images.big.blob)
    assert hashlib.sha256(done.path.read_bytes()).hexdigest() == images.big.digest.removeprefix("sha256:")
    assert _names(tmp_path) == ["big"]


async def test_a_registry_that_stays_dead_is_a_clear_error_and_leaves_nothing(flaky: Registry, tmp_path: Path) -> None:
    if flaky.proc is None or flaky.proc.poll() is not None:
        flaky.start()
    async with RegistryClient(retry=RetryPolicy(attempts=3, base_delay=0.1, max_delay=0.2)) as client:
        image = await client.resolve(parse_reference(f"{flaky.host}/big:1"))
        (desc,) = image.manifest.layers
        with pytest.raises(RegistryUnreachable) as info:
            await client.download_blob(
                image.reference, desc, tmp_path / "big", progress=lambda done, size: flaky.kill()
            )
    assert flaky.host in str(info.value)
    assert _names(tmp_path) == []
    missing = Descriptor(digest=desc.digest, size=desc.size)
    async with RegistryClient(retry=RetryPolicy(attempts=2, base_delay=0.05, max_delay=0.1)) as client:
        with pytest.raises(RegistryUnreachable, match=f"cannot reach registry {flaky.host}"):
            await client.download_blob(image.reference, missing, tmp_path / "again")
    assert _names(tmp_path) == []
