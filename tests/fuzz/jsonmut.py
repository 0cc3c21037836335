"""Structured-but-wrong JSON: a valid document with a few of its nodes replaced, removed or added.

A mutation is (where, what, key, value): ``where`` picks a child at each level (an index into the
sorted keys or the list, modulo its length), ``what`` is "set" (the node becomes ``value``), "del"
(it goes) or "add" (``key: value`` joins a dict, ``value`` a list).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .archives import TOP

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
TAR, TGZ = "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip"
KEYS = st.sampled_from(
    [
        *("mediaType", "digest", "size", "manifests", "config", "layers", "annotations", "platform", "os"),
        *("architecture", "variant", "rootfs", "diff_ids", "Env", "Entrypoint", "Cmd", "WorkingDir", "User"),
        *("Config", "RepoTags", "Layers", "imageLayoutVersion", "org.opencontainers.image.ref.name"),
        *("io.containerd.image.name", "vnd.docker.reference.type", "name", "role", "chunk_size", "chunks"),
        *("format", "created_at", "env", "workdir", "user", "entrypoint", "parent", "owner", "layer", "scrubbed"),
    ]
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.text(max_size=12),
    st.sampled_from(
        [
            *("sha256:" + "0" * 64, "sha512:" + "0" * 128, "sha256:../../secret", "sha256:", INDEX, MANIFEST, CONFIG),
            *(TAR, TGZ, "application/vnd.oci.image.layer.v1.tar+zstd", "linux", "amd64", "arm64", "unknown", "v3"),
            *("attestation-manifest", "../../secret", TOP + "/secret", "", "1.0.0", "2.0", "foo:latest", "/srv/../x"),
            *("PATH=/bin", "=x", "blobs/sha256/", "x.json", "0" * 64, "erofs", "base", "diff", "2024-01-01T00:00:00Z"),
        ]
    ),
)
JSON_ANY = st.recursive(
    LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8
)
# (where: indexes picking a child at each level, what, key for "add", value)
JSON_MUTATIONS = st.tuples(
    st.lists(st.integers(0, 50), max_size=4), st.sampled_from(["set", "del", "add"]), KEYS, JSON_ANY
)


def mutate_json(doc: Any, where: list[int], what: str, key: str, value: Any) -> Any:
    if not where or not isinstance(doc, dict | list) or not doc:
        if what == "set":
            return value
        if what == "add" and isinstance(doc, dict):
            return {**doc, key: value}
        if what == "add" and isinstance(doc, list):
            return [*doc, value]
        return doc
    keys = sorted(doc) if isinstance(doc, dict) else list(range(len(doc)))
    k = keys[where[0] % len(keys)]
    if what == "del" and len(where) == 1:
        if isinstance(doc, dict):
            return {kk: v for kk, v in doc.items() if kk != k}
        return [v for i, v in enumerate(doc) if i != k]
    if isinstance(doc, dict):
        return {**doc, k: mutate_json(doc[k], where[1:], what, key, value)}
    return [mutate_json(v, where[1:], what, key, value) if i == k else v for i, v in enumerate(doc)]
