"""The registry client against an in-process fake registry (httpx.MockTransport): the rules that need no
real server, such as where plain HTTP may go, mirrors, digests, resume and the size bound. The same client
against a real Distribution registry: tests/integration/test_registry_client.py."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dsec.errors import (
    DigestMismatch,
    ImageNotFound,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    RegistryAuthFailed,
    RegistryError,
    RegistryUnreachable,
)
from dsec.images.registry import (
    CredentialStore,
    Descriptor,
    RegistryClient,
    RegistryHosts,
    RetryPolicy,
    parse_reference,
)
from dsec.images.registry.hosts import is_loopback
from dsec.images.registry.manifest import OCI_INDEX, OCI_MANIFEST

FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class CutStream(httpx.AsyncByteStream):
    """A body that breaks off after ``cut`` bytes, as a dropped connection does."""

    def __init__(self, data: bytes, cut: int | None) -> None:
        self.data = data
        self.cut = cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        end = len(self.data) if self.cut is None else self.cut
        for i in range(0, end, 1000):
            yield self.data[i : min(i + 1000, end)]
        if self.cut is not None:
            raise httpx.ReadError("connection reset by peer")


@dataclass
class FakeRegistry:
    """Serves /v2/ manifests and blobs for whatever hosts and schemes the test lets it."""

    manifests: dict[tuple[str, str], tuple[bytes, str]] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    schemes: dict[str, str] = field(default_factory=dict)  # host → the one scheme it speaks
    cuts: list[int] = field(default_factory=list)  # successive blob answers break off at these offsets
    ignore_range: bool = False
    basic: str | None = None  # "user:password" required, if any
    wrong_digest_header: bool = False
    requests: list[httpx.Request] = field(default_factory=list)

    def add_image(self, repo: str, tag: str, config: bytes, layers: list[bytes]) -> bytes:
        for blob in (config, *layers):
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
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha(b), "size": len(b)}
                    for b in layers
                ],
            }
        ).encode()
        self.manifests[(repo, tag)] = self.manifests[(repo, sha(manifest))] = (manifest, OCI_MANIFEST)
        return manifest

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        host = request.url.netloc.decode()
        if self.schemes.get(host, "https") != request.url.scheme:
            raise httpx.ConnectError("wrong version number (the other side speaks another protocol)")
        if self.basic is not None:
            import base64

            want = "Basic " + base64.b64encode(self.basic.encode()).decode()
            if request.headers.get("authorization") != want:
                return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="fake"'})
        parts = request.url.path.split("/")
        if request.url.path == "/v2/":
            return httpx.Response(200, headers={"Docker-Distribution-Api-Version": "registry/2.0"})
        if "manifests" in parts:
            i = parts.index("manifests")
            found = self.manifests.get(("/".join(parts[2:i]), parts[i + 1]))
            if found is None:
                return httpx.Response(
                    404, json={"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}
                )
            body, media = found
            said = sha(body + b"x") if self.wrong_digest_header else sha(body)
            return httpx.Response(200, content=body, headers={"Content-Type": media, "Docker-Content-Digest": said})
        digest = parts[-1]
        blob = self.blobs.get(digest)
        if blob is None:
            return httpx.Response(404, json={"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]})
        return self._blob(request, blob)

    def _blob(self, request: httpx.Request, blob: bytes) -> httpx.Response:
        cut = self.cuts.pop(0) if self.cuts else None
        start = 0
        wanted = request.headers.get("range")
        if wanted and not self.ignore_range:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            part = blob[start:]
            headers = {"Content-Range": f"bytes {start}-{len(blob) - 1}/{len(blob)}", "Content-Length": str(len(part))}
            return httpx.Response(206, headers=headers, stream=CutStream(part, None if cut is None else cut - start))
        return httpx.Response(200, headers={"Content-Length": str(len(blob))}, stream=CutStream(blob, cut))


def client(fake: FakeRegistry, **kwargs: object) -> RegistryClient:
    return RegistryClient(transport=httpx.MockTransport(fake.handler), retry=FAST, **kwargs)  # type: ignore[arg-type]


LAYER = bytes(range(256)) * 400  # 100 KiB
CONFIG = json.dumps(
    {"os": "linux", "architecture": "amd64", "rootfs": {"type": "layers", "diff_ids": [sha(LAYER)]}}
).encode()


def layer_desc() -> Descriptor:
    return Descriptor(digest=sha(LAYER), size=len(LAYER))


# ---- where plain HTTP may go ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("localhost:5000", True),
        ("127.0.0.1:5000", True),
        ("127.3.4.5", True),
        ("[::1]:5000", True),
        ("registry.example", False),
        ("10.0.0.1:5000", False),
        ("localhost.example.com", False),
        ("[::2]", False),
    ],
)
def test_loopback_is_read_from_the_address(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_plain_http_rule() -> None:
    hosts = RegistryHosts.from_options(insecure=["lab.example", "build.example:5000", "10.1.0.0/16"])
    assert hosts.plain_http_allowed("lab.example:1234")
    assert hosts.plain_http_allowed("build.example:5000")
    assert not hosts.plain_http_allowed("build.example:6000")
    assert hosts.plain_http_allowed("10.1.2.3:5000")
    assert not hosts.plain_http_allowed("10.2.0.1:5000")
    assert not hosts.plain_http_allowed("registry.example")
    assert [e.schemes for e in hosts.endpoints("registry.example")] == [("https",)]
    assert [e.schemes for e in hosts.endpoints("localhost:5000")] == [("https", "http")]
    assert hosts.endpoints("docker.io")[-1].host == "registry-1.docker.io"


async def test_plain_http_is_never_tried_for_a_host_that_is_not_loopback_or_insecure() -> None:
    fake = FakeRegistry(schemes={"registry.example": "http"})
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake) as c:
        with pytest.raises(RegistryUnreachable) as info:
            await c.fetch_manifest(parse_reference("registry.example/app:v1"))
    assert "registry.example" in str(info.value)
    assert fake.requests and all(r.url.scheme == "https" for r in fake.requests)


async def test_loopback_and_insecure_hosts_fall_back_to_plain_http() -> None:
    fake = FakeRegistry(schemes={"127.0.0.1:5000": "http", "lab.example": "http"})
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake, hosts=RegistryHosts.from_options(insecure=["lab.example"])) as c:
        for name in ("127.0.0.1:5000/app:v1", "lab.example/app:v1"):
            image = await c.resolve(parse_reference(name))
            assert image.manifest.layers[0].digest == sha(LAYER)
    schemes = [r.url.scheme for r in fake.requests]
    assert schemes[0] == "https" and "http" in schemes


async def test_a_redirect_to_plain_http_is_refused() -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])

    def handler(request: httpx.Request) -> httpx.Response:
        if "/blobs/" in request.url.path:
            return httpx.Response(307, headers={"Location": "http://cdn.example/blob"})
        return fake.handler(request)

    async with RegistryClient(transport=httpx.MockTransport(handler), retry=FAST) as c:
        with pytest.raises(RegistryError, match="plain HTTP"):
            await c.fetch_blob(parse_reference("registry.example/app:v1"), layer_desc(), limit=1 << 20)
    assert not any(r.url.host == "cdn.example" for r in fake.requests)


async def test_credentials_are_not_sent_to_another_host_on_redirect() -> None:
    fake = FakeRegistry(basic="u:p")
    fake.add_image("app", "v1", CONFIG, [LAYER])
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "cdn.example":
            return httpx.Response(200, stream=CutStream(LAYER, None))
        if "/blobs/" in request.url.path and request.headers.get("authorization"):
            return httpx.Response(307, headers={"Location": "https://cdn.example/blob?sig=1"})
        return fake.handler(request)

    creds = CredentialStore.from_mapping({"registry.example": "u:p"})
    async with RegistryClient(transport=httpx.MockTransport(handler), retry=FAST, credentials=creds) as c:
        data = await c.fetch_blob(parse_reference("registry.example/app:v1"), layer_desc(), limit=1 << 20)
    assert data == LAYER
    cdn = [r for r in seen if r.url.host == "cdn.example"]
    assert cdn and all("authorization" not in r.headers for r in cdn)


def test_mirror_urls_are_checked_up_front() -> None:
    with pytest.raises(InvalidRequest, match="plain HTTP"):
        RegistryHosts.from_options(mirrors=["docker.io=http://mirror.example"])
    with pytest.raises(InvalidRequest, match="expected registry=url"):
        RegistryHosts.from_options(mirrors=["https://mirror.example"])
    hosts = RegistryHosts.from_options(
        mirrors=["docker.io=http://127.0.0.1:5000/hub/", "index.docker.io=https://m.example"]
    )
    endpoints = hosts.endpoints("docker.io")
    assert [(e.host, e.prefix, e.schemes, e.mirror) for e in endpoints] == [
        ("127.0.0.1:5000", "/hub", ("http",), True),
        ("m.example", "", ("https",), True),
        ("registry-1.docker.io", "", ("https",), False),
    ]


# ---- mirrors, digests, not found, auth -----------------------------------------------------------------


async def test_mirrors_are_tried_first_and_the_registry_after() -> None:
    fake = FakeRegistry()
    fake.add_image("library/app", "v1", CONFIG, [LAYER])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "mirror.example":
            return httpx.Response(503)
        return fake.handler(request)

    hosts = RegistryHosts.from_options(mirrors=["docker.io=https://mirror.example"])
    async with RegistryClient(transport=httpx.MockTransport(handler), retry=FAST, hosts=hosts) as c:
        fetched = await c.fetch_manifest(parse_reference("app:v1"))
    assert fetched.served_by == "registry docker.io"
    hosts_asked = [r.url.host for r in fake.requests]
    assert hosts_asked == ["registry-1.docker.io"]  # the mirror answered 503 (retried, then passed over)


async def test_digests_are_checked() -> None:
    fake = FakeRegistry()
    manifest = fake.add_image("app", "v1", CONFIG, [LAYER])
    ref = parse_reference("registry.example/app:v1")
    async with client(fake) as c:
        fetched = await c.fetch_manifest(ref)
        assert fetched.digest == sha(manifest)
        assert str(fetched.reference) == f"registry.example/app:v1@{sha(manifest)}"
        fake.wrong_digest_header = True
        with pytest.raises(DigestMismatch, match="the registry says"):
            await c.fetch_manifest(ref)
        fake.wrong_digest_header = False
        # a registry answering a digest request with other content
        other = "sha256:" + "e" * 64
        fake.manifests[("app", other)] = (manifest, OCI_MANIFEST)
        with pytest.raises(DigestMismatch, match=f"not the {other}"):
            await c.fetch_manifest(ref.with_digest(other))
        # a pinned digest that the registry does not have
        with pytest.raises(ImageNotFound, match="has no digest"):
            await c.fetch_manifest(parse_reference(f"registry.example/app@sha256:{'a' * 64}"))


async def test_a_blob_that_is_not_its_digest_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])
    fake.blobs[sha(LAYER)] = LAYER[:-1] + b"\x00"
    async with client(fake) as c:
        with pytest.raises(DigestMismatch, match="refused"):
            await c.download_blob(parse_reference("registry.example/app:v1"), layer_desc(), tmp_path / "layer")
    assert names(tmp_path) == []


async def test_missing_things_are_not_found() -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake) as c:
        with pytest.raises(ImageNotFound, match="has no tag v2 in repository app"):
            await c.fetch_manifest(parse_reference("registry.example/app:v2"))
        with pytest.raises(NotFound, match="has no blob"):
            await c.fetch_blob(parse_reference("registry.example/app"), Descriptor(digest="sha256:" + "1" * 64, size=3))


async def test_basic_auth_and_its_refusal() -> None:
    fake = FakeRegistry(basic="u:p")
    fake.add_image("app", "v1", CONFIG, [LAYER])
    ref = parse_reference("registry.example/app:v1")
    async with client(fake, credentials=CredentialStore.from_mapping({"registry.example": "u:p"})) as c:
        assert (await c.resolve(ref)).config.architecture == "amd64"
    async with client(fake, credentials=CredentialStore.from_mapping({"registry.example": "u:bad"})) as c:
        with pytest.raises(RegistryAuthFailed, match=r"registry registry\.example refused access to app for user 'u'"):
            await c.resolve(ref)
    async with client(fake) as c:
        with pytest.raises(RegistryAuthFailed, match="none are configured"):
            await c.resolve(ref)


async def test_an_index_resolves_to_amd64_and_the_config_must_agree() -> None:
    fake = FakeRegistry()
    amd = fake.add_image("app", "amd", CONFIG, [LAYER])
    arm_config = json.dumps({"os": "linux", "architecture": "arm64"}).encode()
    arm = fake.add_image("app", "arm", arm_config, [b"arm layer"])
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": sha(arm),
                    "size": len(arm),
                    "platform": {"os": "linux", "architecture": "arm64"},
                },
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": sha(amd),
                    "size": len(amd),
                    "platform": {"os": "linux", "architecture": "amd64"},
                },
            ],
        }
    ).encode()
    fake.manifests[("app", "multi")] = (index, OCI_INDEX)
    async with client(fake) as c:
        image = await c.resolve(parse_reference("registry.example/app:multi"))
        assert (image.index_digest, image.digest) == (sha(index), sha(amd))
        assert image.reference.digest == sha(amd) and image.reference.tag == "multi"
        with pytest.raises(InvalidRequest, match="is a linux/arm64 image, not linux/amd64"):
            await c.resolve(parse_reference("registry.example/app:arm"))


# ---- blobs: bound, resume ------------------------------------------------------------------------------


async def test_a_blob_over_the_bound_is_refused_before_fetching(tmp_path: Path) -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake) as c:
        with pytest.raises(LimitExceeded, match="over the limit of 1000"):
            await c.download_blob(parse_reference("registry.example/app"), layer_desc(), tmp_path / "x", max_size=1000)
    assert not [r for r in fake.requests if "/blobs/" in r.url.path]
    assert names(tmp_path) == []


@pytest.mark.parametrize("ignore_range", [False, True])
async def test_a_dropped_blob_resumes_where_it_stopped(tmp_path: Path, ignore_range: bool) -> None:
    fake = FakeRegistry(cuts=[30_000, 70_000], ignore_range=ignore_range)
    fake.add_image("app", "v1", CONFIG, [LAYER])
    seen: list[int] = []
    async with client(fake) as c:
        done = await c.download_blob(
            parse_reference("registry.example/app"),
            layer_desc(),
            tmp_path / "layer",
            progress=lambda n, _: seen.append(n),
        )
    assert (tmp_path / "layer").read_bytes() == LAYER
    assert done.resumes == 2 and done.size == len(LAYER)
    assert seen == sorted(seen) and seen[-1] == len(LAYER)
    ranges = [r.headers.get("range") for r in fake.requests if "/blobs/" in r.url.path]
    assert ranges == [None, "bytes=30000-", "bytes=70000-"]
    assert names(tmp_path) == ["layer"]


async def test_a_blob_that_keeps_failing_ends_with_a_clear_error_and_no_file(tmp_path: Path) -> None:
    fake = FakeRegistry(cuts=[0] * 10)
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake) as c:
        with pytest.raises(RegistryUnreachable) as info:
            await c.download_blob(parse_reference("registry.example/app"), layer_desc(), tmp_path / "layer")
    assert "registry.example" in str(info.value) and "connection failed at byte 0" in str(info.value)
    assert names(tmp_path) == []


async def test_a_registry_sending_more_than_the_size_is_stopped(tmp_path: Path) -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])
    async with client(fake) as c:
        short = Descriptor(digest=sha(LAYER), size=len(LAYER) - 10)
        with pytest.raises(DigestMismatch, match="descriptor says"):
            await c.download_blob(parse_reference("registry.example/app"), short, tmp_path / "layer")
    assert names(tmp_path) == []


async def test_rate_limits_are_retried_after_the_time_asked() -> None:
    fake = FakeRegistry()
    fake.add_image("app", "v1", CONFIG, [LAYER])
    answers: list[Callable[[httpx.Request], httpx.Response]] = [
        lambda r: httpx.Response(429, headers={"Retry-After": "0"}),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.pop(0)(request) if answers else fake.handler(request)

    async with RegistryClient(transport=httpx.MockTransport(handler), retry=FAST) as c:
        assert (await c.fetch_manifest(parse_reference("registry.example/app:v1"))).media_type == OCI_MANIFEST

    async def always(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"errors": [{"code": "TOOMANYREQUESTS", "message": "slow down"}]})

    async with RegistryClient(transport=httpx.MockTransport(always), retry=FAST) as c:
        with pytest.raises(RegistryError, match="rate-limiting"):
            await c.fetch_manifest(parse_reference("registry.example/app:v1"))
