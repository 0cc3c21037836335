"""Fuzzing the image import (images/oci.py): OCI layouts and docker save archives, as directories and
as (gzip-compressed) tars, whose JSON documents are mutated (wrong types, missing and extra keys,
hostile digests, paths and media types; digests recomputed or left stale) and whose files are
replaced by symlinks, directories, FIFOs or nothing. read_image returns an image or raises
InvalidRequest, never hangs; every layer of an image it returns extracts or raises InvalidRequest,
and nothing outside the extraction's destination changes."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dsec.errors import InvalidRequest
from dsec.images.oci import OciImage, extract_layer, read_image

from .archives import TOP, Member, Recipe, build
from .budget import bounded_file_size, bounded_memory, fuzz, outcome
from .fsguard import fuzz_root, snapshot, strange_entries
from .jsonmut import CONFIG, INDEX, JSON_MUTATIONS, MANIFEST, TAR, TGZ, mutate_json

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="extraction needs root: mknod whiteouts, chown, xattrs")

DOCS = ("oci-layout", "index", "manifest", "config", "docker")
FILE_MUTATIONS = st.tuples(
    st.sampled_from(["symlink-out", "symlink-loop", "symlink-up", "dir", "fifo", "remove", "empty"]), st.integers(0, 50)
)
LAYER_MEMBERS = st.lists(
    st.builds(
        Member,
        kind=st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE]),
        name=st.sampled_from(["a", "b", "d/x", ".wh.a", "d/.wh..wh..opq", "../x", TOP + "/x"]),
        linkname=st.sampled_from(["a", "/etc", "../.."]),
        data=st.binary(max_size=16),
    ),
    max_size=3,
)


@dataclass(frozen=True)
class Source:
    form: str  # oci-dir, oci-tar, oci-tgz, docker-dir, docker-tar
    layers: list[list[Member]]
    gz: list[bool]
    nested: bool  # an index in between (a multi-platform image)
    mutations: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    stale: bool = False  # mutated documents keep the digests of the originals
    files: list[tuple[str, int]] = field(default_factory=list)
    reference: str | None = None


SOURCES = st.builds(
    Source,
    form=st.sampled_from(["oci-dir", "oci-dir", "oci-tar", "oci-tgz", "docker-dir", "docker-tar"]),
    layers=st.lists(LAYER_MEMBERS, max_size=2),
    gz=st.lists(st.booleans(), min_size=2, max_size=2),
    nested=st.booleans(),
    mutations=st.lists(st.tuples(st.sampled_from(DOCS), JSON_MUTATIONS), max_size=2),
    stale=st.booleans(),
    files=st.lists(FILE_MUTATIONS, max_size=1),
    reference=st.sampled_from([None, None, "foo", "foo:latest", "docker.io/library/foo:latest", "sha256:00"]),
)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(digest: str) -> str:
    return "blobs/sha256/" + digest.removeprefix("sha256:")


class _Docs:
    def __init__(self, src: Source) -> None:
        self.src = src

    def encode(self, name: str, doc: Any) -> tuple[bytes, str]:
        """(the document's bytes after its mutations, the digest to reference it by)."""
        original = json.dumps(doc).encode()
        for target, (where, what, key, value) in self.src.mutations:
            if target == name:
                doc = mutate_json(doc, where, what, key, value)
        data = json.dumps(doc).encode()
        return data, _sha(original if self.src.stale else data)


def _layout_files(src: Source, top: str) -> dict[str, bytes]:
    docs = _Docs(src)
    files: dict[str, bytes] = {}
    plain = [build(Recipe(members), top) for members in src.layers]
    blobs = [gzip.compress(p, mtime=0) if z else p for p, z in zip(plain, src.gz, strict=False)]
    for b in blobs:
        files[_blob(_sha(b))] = b
    config, config_digest = docs.encode(
        "config",
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["sh"], "WorkingDir": "/srv", "User": "1"},
            "rootfs": {"type": "layers", "diff_ids": [_sha(p) for p in plain]},
        },
    )
    files[_blob(config_digest)] = config
    manifest, manifest_digest = docs.encode(
        "manifest",
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": config_digest, "size": len(config)},
            "layers": [
                {"mediaType": TGZ if z else TAR, "digest": _sha(b), "size": len(b)}
                for b, z in zip(blobs, src.gz, strict=False)
            ],
        },
    )
    files[_blob(manifest_digest)] = manifest
    desc: dict[str, Any] = {"mediaType": MANIFEST, "digest": manifest_digest, "size": len(manifest)}
    if src.nested:
        desc["platform"] = {"os": "linux", "architecture": "amd64"}
        inner = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [desc]}).encode()
        files[_blob(_sha(inner))] = inner
        desc = {"mediaType": INDEX, "digest": _sha(inner), "size": len(inner)}
    desc["annotations"] = {"org.opencontainers.image.ref.name": "foo:latest"}
    files["index.json"] = docs.encode("index", {"schemaVersion": 2, "manifests": [desc]})[0]
    files["oci-layout"] = docs.encode("oci-layout", {"imageLayoutVersion": "1.0.0"})[0]
    if src.form.startswith("docker"):
        entry = {"Config": _blob(config_digest), "RepoTags": ["foo:latest"], "Layers": [_blob(_sha(b)) for b in blobs]}
        files["manifest.json"] = docs.encode("docker", [entry])[0]
    return files


def _apply_file_mutation(root: Path, names: list[str], what: str, pick: int, top: Path) -> None:
    name = names[pick % len(names)]
    path = root / name
    path.unlink()
    if what == "symlink-out":
        path.symlink_to(top / "secret")
    elif what == "symlink-loop":
        path.symlink_to(path.name)
    elif what == "symlink-up":
        path.symlink_to("../" * (name.count("/") + 3) + "secret")
    elif what == "dir":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "empty":
        path.write_bytes(b"")


def make_source(src: Source, top: Path) -> Path:
    files = _layout_files(src, str(top))
    root = top / "source"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    for what, pick in src.files:
        _apply_file_mutation(root, sorted(files), what, pick, top)
    if src.form.endswith("dir"):
        return root
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for name in sorted(files):
            if (root / name).is_symlink() or ((root / name).exists() and not (root / name).is_fifo()):
                tf.add(root / name, arcname=name, recursive=False)
    data = gzip.compress(out.getvalue()) if src.form == "oci-tgz" else out.getvalue()
    (top / "source.tar").write_bytes(data)
    return top / "source.tar"


def _refusal(e: InvalidRequest) -> str:
    words = str(e).replace(str(Path("/dev/shm")), "").split()
    return " ".join(w for w in words[:6] if "/" not in w and "sha256" not in w)


def _extract_all(image: OciImage, top: Path, dest: Path) -> None:
    for i, layer in enumerate(image.layers):
        target = dest / str(i)
        target.mkdir()
        before = snapshot(top, skip=dest)
        try:
            with bounded_memory(), bounded_file_size():
                extract_layer(layer, target)
            outcome("layer extracted")
        except InvalidRequest as e:
            outcome(f"layer refused: {_refusal(e)}")
        assert snapshot(top, skip=dest) == before
        assert strange_entries(target) == []


# (with no layers and no nested index, the layout's files sorted are two blobs, index.json, oci-layout)
# a FIFO in the place of index.json: opening it waited for a writer, for ever
@example(src=Source("oci-dir", [], [False, False], nested=False, files=[("fifo", 2)]))
# a symlink loop in its place: BackendError (a 500), as if the host had failed
@example(src=Source("oci-dir", [], [False, False], nested=False, files=[("symlink-loop", 2)]))
@fuzz(600)
@given(src=SOURCES)
def test_an_image_source_is_read_and_extracted_or_refused(src: Source) -> None:
    with fuzz_root() as (top, dest):
        source = make_source(src, top)
        try:
            image = read_image(source, reference=src.reference)
        except InvalidRequest as e:
            outcome(f"refused: {_refusal(e)}")
            return
        outcome("read")
        assert image.config.workdir.startswith("/") and "/../" not in image.config.workdir + "/"
        _extract_all(image, top, dest)
