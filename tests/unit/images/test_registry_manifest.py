"""Manifests and indexes as registries serve them, and choosing a platform from an index."""

from __future__ import annotations

import json

import pytest

from dsec.errors import InvalidRequest, RegistryError
from dsec.images.registry.manifest import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    LINUX_AMD64,
    OCI_INDEX,
    OCI_MANIFEST,
    ImageIndex,
    Platform,
    parse_document,
    select_platform,
)


def _digest(n: int) -> str:
    return "sha256:" + f"{n:064x}"


def _entry(n: int, platform: dict[str, str] | None, **annotations: str) -> dict[str, object]:
    entry: dict[str, object] = {"mediaType": OCI_MANIFEST, "digest": _digest(n), "size": 100 + n}
    if platform is not None:
        entry["platform"] = platform
    if annotations:
        entry["annotations"] = annotations
    return entry


def _index(*entries: dict[str, object]) -> ImageIndex:
    return ImageIndex.model_validate({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(entries)})


AMD64 = {"os": "linux", "architecture": "amd64"}
ARM64 = {"os": "linux", "architecture": "arm64", "variant": "v8"}


def test_amd64_is_chosen_by_default() -> None:
    index = _index(_entry(1, ARM64), _entry(2, AMD64), _entry(3, {"os": "windows", "architecture": "amd64"}))
    assert select_platform(index, LINUX_AMD64, "idx").digest == _digest(2)


def test_a_given_platform_is_chosen() -> None:
    index = _index(_entry(1, AMD64), _entry(2, ARM64))
    assert select_platform(index, Platform.parse("linux/arm64"), "idx").digest == _digest(2)
    assert select_platform(index, Platform.parse("linux/arm64/v8"), "idx").digest == _digest(2)
    # an arm64 entry that does not write its variant is v8
    bare = _index(_entry(3, {"os": "linux", "architecture": "arm64"}))
    assert select_platform(bare, Platform.parse("linux/arm64/v8"), "idx").digest == _digest(3)


def test_the_baseline_variant_wins_over_newer_ones() -> None:
    index = _index(
        _entry(1, {"os": "linux", "architecture": "amd64", "variant": "v3"}),
        _entry(2, {"os": "linux", "architecture": "amd64", "variant": "v2"}),
        _entry(3, AMD64),
    )
    assert select_platform(index, LINUX_AMD64, "idx").digest == _digest(3)
    without_baseline = _index(
        index.manifests[0].model_dump(by_alias=True), index.manifests[1].model_dump(by_alias=True)
    )
    assert select_platform(without_baseline, LINUX_AMD64, "idx").digest == _digest(2)


def test_a_variant_asked_for_must_match() -> None:
    index = _index(_entry(1, {"os": "linux", "architecture": "arm", "variant": "v6"}))
    with pytest.raises(InvalidRequest, match="no linux/arm/v7 image"):
        select_platform(index, Platform.parse("linux/arm/v7"), "idx")


def test_attestations_are_never_chosen() -> None:
    index = _index(
        _entry(1, {"os": "unknown", "architecture": "unknown"}),
        _entry(2, AMD64, **{"vnd.docker.reference.type": "attestation-manifest"}),
        _entry(3, AMD64),
    )
    assert select_platform(index, LINUX_AMD64, "idx").digest == _digest(3)


def test_no_matching_platform_lists_what_there_is() -> None:
    index = _index(_entry(1, ARM64), _entry(2, None), _entry(3, {"os": "unknown", "architecture": "unknown"}))
    with pytest.raises(InvalidRequest) as info:
        select_platform(index, LINUX_AMD64, "myimage")
    assert str(info.value) == "myimage has no linux/amd64 image (platforms: linux/arm64/v8, unspecified)"


@pytest.mark.parametrize("text", ["linux", "linux/", "/amd64", "a/b/c/d", ""])
def test_bad_platforms(text: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid platform"):
        Platform.parse(text)


MANIFEST = {
    "schemaVersion": 2,
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(9), "size": 10},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _digest(8), "size": 20}],
}


def test_documents_are_read_by_declared_type_then_header_then_shape() -> None:
    data = json.dumps({**MANIFEST, "mediaType": DOCKER_MANIFEST}).encode()
    assert parse_document(data, "text/plain", "m").media_type == DOCKER_MANIFEST
    plain = json.dumps(MANIFEST).encode()
    assert parse_document(plain, f"{OCI_MANIFEST}; charset=utf-8", "m").media_type == OCI_MANIFEST
    doc = parse_document(plain, "application/octet-stream", "m")
    assert doc.manifest is not None and doc.manifest.layers[0].size == 20
    lst = json.dumps({"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": [_entry(1, AMD64)]}).encode()
    listed = parse_document(lst, "", "l")
    assert listed.index is not None and listed.media_type == DOCKER_LIST


@pytest.mark.parametrize(
    ("data", "content_type", "message"),
    [
        (b"not json", "", "is not JSON"),
        (b"[1]", "", "not a JSON object"),
        (json.dumps({"schemaVersion": 1, "name": "x"}).encode(), "", "schema 1"),
        (
            json.dumps({"schemaVersion": 2, "config": {}}).encode(),
            "application/vnd.docker.distribution.manifest.v1+prettyjws",
            "schema 1",
        ),
        (json.dumps({**MANIFEST, "schemaVersion": 3}).encode(), "", "schemaVersion 3"),
        (
            json.dumps({**MANIFEST, "mediaType": "application/vnd.oci.artifact.manifest.v1+json"}).encode(),
            "",
            "not an image",
        ),
        (
            json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": []}).encode(),
            "",
            "config: Field required",
        ),
    ],
)
def test_bad_documents(data: bytes, content_type: str, message: str) -> None:
    with pytest.raises(RegistryError) as info:
        parse_document(data, content_type, "manifest x")
    assert message in str(info.value)
    assert str(info.value).startswith("manifest x")
