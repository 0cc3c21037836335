"""Importing images from disk: OCI layouts and docker save archives, read, verified and extracted safely."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import InvalidRequest
from dsec.images import layer_stream
from dsec.images.model import DEFAULT_PATH, ImageConfig
from dsec.images.oci import LayerSource, OciImage, extract_layer, read_image

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="extraction needs root: mknod whiteouts, chown, trusted.* xattrs")

MT = 1_600_000_000
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
TAR = "application/vnd.oci.image.layer.v1.tar"
TGZ = "application/vnd.oci.image.layer.v1.tar+gzip"
BIN_XATTR = b"\x00\xffbin"

Member = tuple[tarfile.TarInfo, bytes | None]
Files = dict[str, bytes]


# ---- building archives -------------------------------------------------------------------------------


def _info(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, **kw: Any) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, uid, gid, MT
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def reg(name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0, **kw: Any) -> Member:
    return _info(name, tarfile.REGTYPE, mode, uid, gid, size=len(data), **kw), data


def dir_(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Member:
    return _info(name, tarfile.DIRTYPE, mode, uid, gid), None


def sym(name: str, target: str) -> Member:
    return _info(name, tarfile.SYMTYPE, 0o777, linkname=target), None


def hard(name: str, target: str) -> Member:
    return _info(name, tarfile.LNKTYPE, 0o644, linkname=target), None


def dev(name: str, kind: bytes, major: int = 0, minor: int = 0) -> Member:
    return _info(name, kind, 0o666, devmajor=major, devminor=minor), None


def make_tar(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(digest: str) -> str:
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def jdump(obj: object) -> bytes:
    return json.dumps(obj).encode()


def write_dir(root: Path, files: Files) -> Path:
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def write_tar(path: Path, files: Files, gz: bool = False) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())
    return path


# ---- the image under test ----------------------------------------------------------------------------

L1 = [
    dir_("./"),
    dir_("etc/"),
    reg("etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
    sym("etc/abs-link", "/etc/passwd"),
    reg("etc/evil-xattr", b"x", pax_headers={"SCHILY.xattr.trusted.overlay.opaque": "y"}),
    dir_("usr/"),
    dir_("usr/bin/"),
    reg("usr/bin/tool", b"#!tool\n", 0o755),
    reg("usr/bin/su", b"su binary", 0o4755),
    hard("usr/bin/tool-link", "usr/bin/tool"),
    sym("bin", "usr/bin"),
    dir_("tmp/", 0o1777),
    dir_("home/user/", 0o750, 1000, 1000),
    reg(
        "home/user/notes",
        b"mine",
        0o600,
        1000,
        1000,
        pax_headers={
            "SCHILY.xattr.user.note": "hello",
            "SCHILY.xattr.user.bin": BIN_XATTR.decode("utf-8", "surrogateescape"),
        },
    ),
    dir_("dev/"),
    dev("dev/null", tarfile.CHRTYPE, 1, 3),
    dev("dev/fifo", tarfile.FIFOTYPE),
]
L2 = [
    reg("usr/bin/.wh.tool", b""),
    dir_("opt/"),
    reg("opt/.wh..wh..opq", b""),
    reg("opt/new", b"fresh"),
    reg("var/.wh.cache", b""),
    reg("etc/hostname", b"box\n"),
]
L3 = [reg("etc/motd", b"hi\n", 0o444)]

CONFIG_BODY = {
    "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY=", "EQ=a=b"],
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo hi"],
    "WorkingDir": "/srv",
    "User": "1000:1000",
    "Labels": {"org.opencontainers.image.title": "t"},
    "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
}
EXPECTED_CONFIG = ImageConfig(
    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "EMPTY": "", "EQ": "a=b"},
    workdir="/srv",
    user="1000:1000",
    entrypoint=["/bin/sh", "-c"],
    cmd=["echo hi"],
    labels={"org.opencontainers.image.title": "t"},
    exposed_ports=["53/udp", "8080/tcp"],
)


@dataclass
class Image:
    plain: list[bytes]  # the uncompressed layer tars
    blobs: list[bytes]  # the layers as stored
    types: list[str]
    config: bytes
    manifest: bytes

    @property
    def files(self) -> Files:
        """Its blobs, as an OCI layout names them."""
        out = {blob_path(sha(b)): b for b in (*self.blobs, self.config, self.manifest)}
        return out

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": OCI_MANIFEST, "digest": sha(self.manifest), "size": len(self.manifest), **extra}


def build(
    layers: list[list[Member]] | None = None,
    gz: tuple[bool, ...] = (False, True, False),
    body: dict[str, Any] | None = None,
    arch: str = "amd64",
    layer_types: list[str] | None = None,
) -> Image:
    plain = [make_tar(m) for m in (layers or [L1, L2, L3])]
    blobs = [gzip.compress(p, mtime=0) if z else p for p, z in zip(plain, gz, strict=False)]
    types = layer_types or [TGZ if z else TAR for z in gz[: len(blobs)]]
    cfg = {
        "architecture": arch,
        "os": "linux",
        "config": CONFIG_BODY if body is None else body,
        "rootfs": {"type": "layers", "diff_ids": [sha(p) for p in plain]},
    }
    config = jdump(cfg)
    manifest = jdump(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": sha(config), "size": len(config)},
            "layers": [{"mediaType": t, "digest": sha(b), "size": len(b)} for t, b in zip(types, blobs, strict=True)],
        }
    )
    return Image(plain, blobs, types, config, manifest)


def layout(index: list[dict[str, Any]], *images: Image, extra: Files | None = None) -> Files:
    files: Files = {"oci-layout": jdump({"imageLayoutVersion": "1.0.0"})}
    for img in images:
        files.update(img.files)
    files["index.json"] = jdump({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": index})
    files.update(extra or {})
    return files


def docker_legacy(entries: list[tuple[Image, list[str]]]) -> Files:
    files: Files = {}
    manifest = []
    for img, tags in entries:
        cfg_name = sha(img.config).removeprefix("sha256:") + ".json"
        files[cfg_name] = img.config
        paths = []
        for i, p in enumerate(img.plain):
            layer_id = hashlib.sha256(b"v1 id %d" % i + img.config).hexdigest()
            files[f"{layer_id}/layer.tar"] = p  # the legacy format stores layers uncompressed
            files[f"{layer_id}/VERSION"] = b"1.0"
            paths.append(f"{layer_id}/layer.tar")
        manifest.append({"Config": cfg_name, "RepoTags": tags, "Layers": paths})
    files["manifest.json"] = jdump(manifest)
    return files


def docker_25(img: Image, tags: list[str]) -> Files:
    """Docker 25+ embeds an OCI layout and points manifest.json at its blobs."""
    files = layout([img.descriptor(annotations={"io.containerd.image.name": "docker.io/library/" + tags[0]})], img)
    manifest = [
        {"Config": blob_path(sha(img.config)), "RepoTags": tags, "Layers": [blob_path(sha(b)) for b in img.blobs]}
    ]
    files["manifest.json"] = jdump(manifest)
    return files


# ---- looking at results --------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under root: kind, content or target, permission bits, owner, xattrs."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (".", *dirnames, *filenames) if dirpath == str(root) else (*dirnames, *filenames):
            p = Path(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                detail: Any = ("file", p.read_bytes())
            elif stat.S_ISDIR(st.st_mode):
                detail = ("dir", None)
            elif stat.S_ISLNK(st.st_mode):
                detail = ("symlink", os.readlink(p))
            elif stat.S_ISCHR(st.st_mode):
                detail = ("chr", (os.major(st.st_rdev), os.minor(st.st_rdev)))
            else:
                detail = ("other", None)
            xattrs = {k: os.getxattr(p, k, follow_symlinks=False) for k in os.listxattr(p, follow_symlinks=False)}
            rel = os.path.normpath(p.relative_to(root))
            out[rel] = (*detail, oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid, xattrs)
    return out


def F(
    data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0, xattrs: dict[str, bytes] | None = None
) -> tuple[Any, ...]:
    return ("file", data, oct(mode), uid, gid, xattrs or {})


def D(mode: int = 0o755, uid: int = 0, gid: int = 0, xattrs: dict[str, bytes] | None = None) -> tuple[Any, ...]:
    return ("dir", None, oct(mode), uid, gid, xattrs or {})


def S(target: str) -> tuple[Any, ...]:
    return ("symlink", target, oct(0o777), 0, 0, {})


WHITEOUT: tuple[Any, ...] = ("chr", (0, 0), oct(0), 0, 0, {})
OPAQUE = {"trusted.overlay.opaque": b"y"}

EXPECTED = [
    {
        ".": D(),
        "etc": D(),
        "etc/passwd": F(b"root:x:0:0::/root:/bin/sh\n"),
        "etc/abs-link": S("/etc/passwd"),
        "etc/evil-xattr": F(b"x"),
        "usr": D(),
        "usr/bin": D(),
        "usr/bin/tool": F(b"#!tool\n", 0o755),
        "usr/bin/tool-link": F(b"#!tool\n", 0o755),
        "usr/bin/su": F(b"su binary", 0o4755),
        "bin": S("usr/bin"),
        "tmp": D(0o1777),
        "home": D(),  # not in the archive: an implicit parent
        "home/user": D(0o750, 1000, 1000),
        "home/user/notes": F(b"mine", 0o600, 1000, 1000, {"user.note": b"hello", "user.bin": BIN_XATTR}),
        "dev": D(),
    },
    {
        "usr": D(),
        "usr/bin": D(),
        "usr/bin/tool": WHITEOUT,
        "opt": D(xattrs=OPAQUE),
        "opt/new": F(b"fresh"),
        "var": D(),
        "var/cache": WHITEOUT,
        "etc": D(),
        "etc/hostname": F(b"box\n"),
    },
    {"etc": D(), "etc/motd": F(b"hi\n", 0o444)},
]


def extract_all(image: OciImage, base: Path) -> list[dict[str, tuple[Any, ...]]]:
    out = []
    for i, layer in enumerate(image.layers):
        dest = base / f"layer-{i}"
        dest.mkdir(parents=True)
        extract_layer(layer, dest)
        snap = snapshot(dest)
        if i > 0:
            snap.pop(".")  # L2 and L3 have no "./" entry: the root is what the caller made
        out.append(snap)
    return out


# ---- reading ------------------------------------------------------------------------------------------


def test_layout_reads_config_and_layers(tmp_path: Path) -> None:
    img = build()
    src = write_dir(
        tmp_path / "oci", layout([img.descriptor(annotations={"org.opencontainers.image.ref.name": "demo:1"})], img)
    )
    image = read_image(src)
    assert image.config == EXPECTED_CONFIG
    assert image.source_ref == "demo:1"
    assert image.manifest_digest == sha(img.manifest)
    assert [la.compression for la in image.layers] == ["none", "gzip", "none"]
    assert [la.digest for la in image.layers] == [sha(b) for b in img.blobs]
    assert [la.diff_id for la in image.layers] == [sha(p) for p in img.plain]
    assert [la.size for la in image.layers] == [len(b) for b in img.blobs]
    assert image.layers[1].media_type == TGZ


def test_config_defaults(tmp_path: Path) -> None:
    img = build(layers=[L3], gz=(False,), body={"Env": ["LANG=C"], "WorkingDir": "app//x"})
    image = read_image(write_dir(tmp_path / "oci", layout([img.descriptor()], img)))
    assert image.config == ImageConfig(env={"LANG": "C", "PATH": DEFAULT_PATH}, workdir="/app/x", user="root")
    assert image.source_ref is None
    empty = build(layers=[L3], gz=(False,), body={})
    assert read_image(write_dir(tmp_path / "oci2", layout([empty.descriptor()], empty))).config == ImageConfig()


def test_multi_manifest_index_selected_by_reference(tmp_path: Path) -> None:
    a = build(layers=[L3], gz=(False,), body={"Env": ["WHICH=a"]})
    b = build(layers=[L3], gz=(True,), body={"Env": ["WHICH=b"]})
    index = [
        a.descriptor(annotations={"org.opencontainers.image.ref.name": "a:1"}),
        b.descriptor(annotations={"org.opencontainers.image.ref.name": "example.com/b:2"}),
    ]
    src = write_dir(tmp_path / "oci", layout(index, a, b))
    with pytest.raises(InvalidRequest, match=r"several images; choose one with reference=: a:1, example.com/b:2"):
        read_image(src)
    assert read_image(src, reference="a:1").config.env["WHICH"] == "a"
    chosen = read_image(src, reference="example.com/b:2")
    assert (chosen.config.env["WHICH"], chosen.source_ref, chosen.layers[0].compression) == (
        "b",
        "example.com/b:2",
        "gzip",
    )
    assert read_image(src, reference=sha(a.manifest)).config.env["WHICH"] == "a"
    with pytest.raises(InvalidRequest, match=r"no image 'c:3' in .*it holds: a:1, example.com/b:2"):
        read_image(src, reference="c:3")


def _platform_image(arch: str) -> Image:
    return build(layers=[L3], gz=(False,), body={"Env": [f"ARCH={arch}"]}, arch=arch)


def _platform_index(*images: tuple[Image, str]) -> bytes:
    manifests: list[dict[str, Any]] = [
        img.descriptor(platform={"os": "linux", "architecture": arch}) for img, arch in images
    ]
    return jdump({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests})


def test_multi_platform_index_picks_linux_amd64(tmp_path: Path) -> None:
    arm, amd, attest = _platform_image("arm64"), _platform_image("amd64"), _platform_image("amd64")
    nested = json.loads(_platform_index((arm, "arm64"), (amd, "amd64")))
    # BuildKit's provenance manifests sit beside the real ones; they must never be chosen
    nested["manifests"].insert(
        0,
        attest.descriptor(
            platform={"os": "unknown", "architecture": "unknown"},
            annotations={"vnd.docker.reference.type": "attestation-manifest"},
        ),
    )
    nested_blob = jdump(nested)
    top = {
        "mediaType": OCI_INDEX,
        "digest": sha(nested_blob),
        "size": len(nested_blob),
        "annotations": {"org.opencontainers.image.ref.name": "multi:1"},
    }
    src = write_dir(tmp_path / "oci", layout([top], arm, amd, attest, extra={blob_path(sha(nested_blob)): nested_blob}))
    image = read_image(src)
    assert image.config.env["ARCH"] == "amd64"
    assert image.manifest_digest == sha(amd.manifest)
    assert image.source_ref == "multi:1"

    # the platforms listed directly in index.json
    flat = json.loads(_platform_index((arm, "arm64"), (amd, "amd64")))["manifests"]
    assert read_image(write_dir(tmp_path / "flat", layout(flat, arm, amd))).config.env["ARCH"] == "amd64"

    only_arm = json.loads(_platform_index((arm, "arm64")))["manifests"]
    only_arm.append(_platform_image("s390x").descriptor(platform={"os": "linux", "architecture": "s390x"}))
    with pytest.raises(InvalidRequest, match=r"no linux/amd64 image \(platforms: linux/arm64, linux/s390x\)"):
        read_image(write_dir(tmp_path / "arm", layout(only_arm, arm, _platform_image("s390x"))))


def test_wrong_architecture_refused(tmp_path: Path) -> None:
    arm = _platform_image("arm64")
    with pytest.raises(InvalidRequest, match="linux/arm64 image; dsec runs linux/amd64"):
        read_image(write_dir(tmp_path / "oci", layout([arm.descriptor()], arm)))


def test_docker_save_variants_read_the_same(tmp_path: Path) -> None:
    img = build()
    sources = {
        "legacy": write_tar(tmp_path / "legacy.tar", docker_legacy([(img, ["demo:1"])])),
        "legacy-gz": write_tar(tmp_path / "legacy.tar.gz", docker_legacy([(img, ["demo:1"])]), gz=True),
        "legacy-dir": write_dir(tmp_path / "legacy-dir", docker_legacy([(img, ["demo:1"])])),
        "docker25": write_tar(tmp_path / "d25.tar", docker_25(img, ["demo:1"])),
        "oci-archive": write_tar(tmp_path / "oci.tar", layout([img.descriptor()], img)),
    }
    for kind, src in sources.items():
        image = read_image(src)
        assert image.config == EXPECTED_CONFIG, kind
        assert [la.diff_id for la in image.layers] == [sha(p) for p in img.plain], kind
        if kind.startswith("legacy"):
            assert image.source_ref == "demo:1"
            assert [la.digest for la in image.layers] == [None] * 3
            assert [la.compression for la in image.layers] == ["none"] * 3
        else:
            assert [la.digest for la in image.layers] == [sha(b) for b in img.blobs], kind
            assert [la.compression for la in image.layers] == ["none", "gzip", "none"], kind


def test_docker_save_reference_selection(tmp_path: Path) -> None:
    a = build(layers=[L3], gz=(False,), body={"Env": ["WHICH=a"]})
    b = build(layers=[L3], gz=(False,), body={"Env": ["WHICH=b"]})
    src = write_tar(
        tmp_path / "two.tar", docker_legacy([(a, ["alpha:1", "alpha:latest"]), (b, ["registry.io/beta:2"])])
    )
    with pytest.raises(
        InvalidRequest, match=r"several images; choose one with reference=: alpha:1, registry\.io/beta:2"
    ):
        read_image(src)
    image = read_image(src, reference="docker.io/library/alpha")  # the familiar form matches alpha:latest
    assert (image.config.env["WHICH"], image.source_ref) == ("a", "alpha:latest")
    assert read_image(src, reference="registry.io/beta:2").config.env["WHICH"] == "b"
    assert read_image(src, reference=sha(b.config)).config.env["WHICH"] == "b"
    with pytest.raises(InvalidRequest, match="no image 'gamma' in"):
        read_image(src, reference="gamma")


# ---- extracting -------------------------------------------------------------------------------------


@needs_root
def test_extract_layout_exactly(tmp_path: Path) -> None:
    img = build()
    image = read_image(write_dir(tmp_path / "oci", layout([img.descriptor()], img)))
    got = extract_all(image, tmp_path / "out")
    assert got == EXPECTED

    l1 = tmp_path / "out/layer-0"
    assert os.lstat(l1 / "usr/bin/tool").st_ino == os.lstat(l1 / "usr/bin/tool-link").st_ino
    assert os.lstat(l1 / "usr/bin/tool").st_nlink == 2
    for rel in ("etc/passwd", "etc/abs-link", "usr/bin/su", "home/user", "tmp", "."):
        assert os.lstat(l1 / rel).st_mtime_ns == MT * 10**9, rel


@needs_root
def test_extract_stats(tmp_path: Path) -> None:
    img = build()
    image = read_image(write_dir(tmp_path / "oci", layout([img.descriptor()], img)))
    (tmp_path / "a").mkdir()
    s1 = extract_layer(image.layers[0], tmp_path / "a")
    assert (s1.files, s1.dirs, s1.symlinks, s1.hardlinks, s1.whiteouts, s1.opaque_dirs) == (
        5,
        6,
        2,
        1,
        0,
        0,
    )  # "./" is the root, not a new directory
    assert s1.bytes == sum(len(d) for ti, d in L1 if d is not None and ti.isreg())
    assert s1.skipped == [
        "etc/evil-xattr: xattr 'trusted.overlay.opaque' not applied: "
        "reserved (overlayfs reads these; an archive must not set them)",
        "dev/null: character device not extracted",
        "dev/fifo: FIFO not extracted",
    ]
    (tmp_path / "b").mkdir()
    s2 = extract_layer(image.layers[1], tmp_path / "b")
    assert (s2.files, s2.dirs, s2.whiteouts, s2.opaque_dirs, s2.skipped) == (2, 1, 2, 1, [])


@needs_root
def test_docker_saves_extract_like_the_layout(tmp_path: Path) -> None:
    img = build()
    legacy = read_image(write_tar(tmp_path / "legacy.tar.gz", docker_legacy([(img, ["demo:1"])]), gz=True))
    assert extract_all(legacy, tmp_path / "legacy") == EXPECTED
    d25 = read_image(write_tar(tmp_path / "d25.tar", docker_25(img, ["demo:1"])))
    assert extract_all(d25, tmp_path / "d25") == EXPECTED


@needs_root
def test_same_layer_overrides(tmp_path: Path) -> None:
    """Within one layer a later member wins, and a whiteout never removes what the layer itself made."""
    members = [
        sym("a", "/etc"),
        reg("a", b"now a file"),  # replaces the symlink; /etc is never opened
        dir_("d/"),
        reg("d/x", b"x"),
        reg(".wh.d", b""),  # d stays, but must now hide lower layers' d
        reg(".wh.e", b""),
        dir_("e/"),  # replaces the whiteout: a new, opaque directory
        reg("f", b"file"),
        reg(".wh.f", b""),  # f stays
        dir_("g/"),
        reg("g/y", b"y"),
        reg("g", b"g is a file now"),
        reg("h/z", b"under an implicit parent"),
        reg(".wh.k", b""),
        reg("k/z", b"k is a new directory"),  # through the whiteout, without a "k/" member
    ]
    dest = tmp_path / "dest"
    stats = extract_layer(raw_layer(tmp_path, make_tar(members)), dest)
    snap = snapshot(dest)
    snap.pop(".")
    assert snap == {
        "a": F(b"now a file"),
        "d": D(xattrs=OPAQUE),
        "d/x": F(b"x"),
        "e": D(xattrs=OPAQUE),
        "f": F(b"file"),
        "g": F(b"g is a file now"),
        "h": D(),
        "h/z": F(b"under an implicit parent"),
        "k": D(xattrs=OPAQUE),
        "k/z": F(b"k is a new directory"),
    }
    assert stats.opaque_dirs == 3


# ---- hostile and broken input -----------------------------------------------------------------------


def raw_layer(tmp_path: Path, data: bytes, compression: Any = "none") -> LayerSource:
    blob = tmp_path / f"blob-{sha(data)[7:19]}"
    blob.write_bytes(data)
    opener: Callable[[], Any] = lambda: open(blob, "rb")  # noqa: E731
    return LayerSource(sha(data), None, TAR, len(data), compression, f"test blob {blob.name}", opener)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    (o / "secret").write_bytes(b"s3cret")
    return o


def assert_untouched(tmp_path: Path, outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"s3cret"
    assert os.stat(outside / "secret").st_nlink == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "pwned").exists()


HOSTILE: dict[str, tuple[Callable[[Path], list[Member]], str]] = {
    "dotdot": (lambda o: [reg("../x", b"x")], r"member '../x' has a '..' component"),
    "dotdot-inner": (lambda o: [reg("a/../../x", b"x")], r"'\.\.' component"),
    "absolute": (lambda o: [reg(f"{o}/pwned", b"x")], r"is an absolute path"),
    "symlink-then-write": (lambda o: [sym("a", str(o)), reg("a/pwned", b"x")], r"member 'a/pwned': a is a symlink"),
    "relative-symlink": (lambda o: [sym("a", "../outside"), reg("a/pwned", b"x")], r"a is a symlink"),
    "symlink-then-dir": (lambda o: [sym("a", str(o)), dir_("a/pwned/")], r"a is a symlink"),
    "symlink-deep": (lambda o: [dir_("d/"), sym("d/a", str(o)), reg("d/a/b/pwned", b"x")], r"d/a is a symlink"),
    "symlink-then-opaque": (lambda o: [sym("a", str(o)), reg("a/.wh..wh..opq", b"")], r"a is a symlink"),
    "symlink-then-whiteout": (lambda o: [sym("a", str(o)), reg("a/.wh.secret", b"")], r"a is a symlink"),
    "symlink-then-hardlink": (lambda o: [reg("f", b"f"), sym("a", str(o)), hard("a/pwned", "f")], r"a is a symlink"),
    "hardlink-outside": (
        lambda o: [hard("h", "../outside/secret")],
        r"hardlink 'h' target '../outside/secret' has a '..'",
    ),
    "hardlink-absolute": (lambda o: [hard("h", f"{o}/secret")], r"target .* is an absolute path"),
    "hardlink-through-symlink": (lambda o: [sym("s", str(o)), hard("h", "s/secret")], r"s is a symlink"),
    "hardlink-to-symlink": (lambda o: [sym("s", f"{o}/secret"), hard("h", "s")], r"not a file extracted before it"),
    "hardlink-missing": (
        lambda o: [hard("h", "nowhere")],
        r"hardlink 'h' points at 'nowhere', which is not a file extracted",
    ),
    "hardlink-later": (lambda o: [hard("h", "f"), reg("f", b"f")], r"not a file extracted before it"),
    "file-as-parent": (lambda o: [reg("f", b"f"), reg("f/x", b"x")], r"member 'f/x': f is not a directory"),
    "root-as-file": (lambda o: [reg("./", b"")], r"names the layer root but is not a directory"),
    "whiteout-dotdot": (lambda o: [reg(".wh...", b"")], r"whiteout '.wh...' names no entry"),
}


@needs_root
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_members_refused(case: str, tmp_path: Path, outside: Path) -> None:
    make, message = HOSTILE[case]
    layer = raw_layer(tmp_path, make_tar(make(outside)))
    with pytest.raises(InvalidRequest, match=message):
        extract_layer(layer, tmp_path / "dest")
    assert_untouched(tmp_path, outside)


def _corrupt_checksum(data: bytes, header_offset: int) -> bytes:
    b = bytearray(data)
    b[header_offset + 148 : header_offset + 156] = b"0000000\0"
    return bytes(b)


@needs_root
def test_truncated_and_corrupt_archives(tmp_path: Path, outside: Path) -> None:
    data = make_tar([reg("a", b"A" * 3000), reg("b", b"B" * 3000)])
    gz = gzip.compress(data)
    cases: dict[str, tuple[bytes, str]] = {
        "mid-data": (data[:2000], "none"),
        "mid-header": (data[: 3584 + 200], "none"),  # 512-byte header + 3000 bytes (padded to 3072) + 200
        "bad-checksum": (_corrupt_checksum(data, 3584), "none"),
        "gzip-truncated": (gz[: len(gz) // 2], "gzip"),
        "gzip-garbage": (b"\x1f\x8b" + b"\x08" + os.urandom(64), "gzip"),
        "not-a-tar": (b"hello world" * 100, "none"),
    }
    for i, (name, (blob, comp)) in enumerate(cases.items()):
        with pytest.raises(InvalidRequest, match="corrupt or truncated"):
            extract_layer(raw_layer(tmp_path, blob, comp), tmp_path / f"dest-{i}")
        assert name
    assert_untouched(tmp_path, outside)
    # a tar ending exactly at a member boundary, without end-of-archive blocks, is tolerated
    whole = make_tar([reg("a", b"A" * 512)])
    extract_layer(raw_layer(tmp_path, whole[:1024]), tmp_path / "dest-ok")
    assert (tmp_path / "dest-ok/a").read_bytes() == b"A" * 512


def test_digest_mismatch_refused(tmp_path: Path) -> None:
    img = build()
    files = layout([img.descriptor()], img)
    name = blob_path(sha(img.blobs[2]))
    files[name] = files[name][:-1] + b"!"  # same size, different bytes
    with pytest.raises(InvalidRequest, match=r"layer 3 .* does not match its digest"):
        read_image(write_dir(tmp_path / "oci", files))

    files = layout([img.descriptor()], img)
    files[blob_path(sha(img.config))] = img.config.replace(b"amd64", b"AMD64")
    with pytest.raises(InvalidRequest, match=r"config .* does not match its digest"):
        read_image(write_dir(tmp_path / "oci2", files))

    files = docker_legacy([(img, ["demo:1"])])
    layer = next(k for k in files if k.endswith("layer.tar"))
    files[layer] = files[layer].replace(b"root:x", b"root:y")
    with pytest.raises(InvalidRequest, match=r"does not match its diff_id"):
        read_image(write_tar(tmp_path / "d.tar", files))


@needs_root
def test_blob_changed_after_read_is_refused(tmp_path: Path) -> None:
    img = build()
    src = write_dir(tmp_path / "oci", layout([img.descriptor()], img))
    image = read_image(src)
    blob = src / blob_path(sha(img.blobs[0]))
    blob.write_bytes(blob.read_bytes().replace(b"root:x", b"root:y"))
    with pytest.raises(InvalidRequest, match="changed since it was read"):
        extract_layer(image.layers[0], tmp_path / "dest")


def test_missing_blob_refused(tmp_path: Path) -> None:
    img = build()
    files = layout([img.descriptor()], img)
    del files[blob_path(sha(img.blobs[1]))]
    with pytest.raises(InvalidRequest, match=r"blobs/sha256/[0-9a-f]{64} is missing from"):
        read_image(write_dir(tmp_path / "oci", files))
    with pytest.raises(InvalidRequest, match=r"is missing from .*\.tar"):
        read_image(write_tar(tmp_path / "oci.tar", files))


def test_zstd_layer_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a node without the zstandard module (it is a dependency of dsec: imported as absent here)
    monkeypatch.setattr(layer_stream, "zstd_module", lambda: None)
    # refused on its media type, before the blob is even read
    img = build(layers=[L3], gz=(False,), layer_types=["application/vnd.oci.image.layer.v1.tar+zstd"])
    files = layout([img.descriptor()], img)
    with pytest.raises(InvalidRequest, match="zstd-compressed, which needs the Python module 'zstandard'"):
        read_image(write_dir(tmp_path / "oci", files))
    # mislabelled as gzip, recognised by its magic (never decompressed)
    zstd = b"\x28\xb5\x2f\xfd" + os.urandom(32)
    bad = build(layers=[L3], gz=(False,), layer_types=[TGZ])
    files = layout([bad.descriptor()], bad)
    name = blob_path(sha(bad.blobs[0]))
    files.pop(name)
    manifest = json.loads(bad.manifest)
    manifest["layers"][0].update(digest=sha(zstd), size=len(zstd))
    files[blob_path(sha(zstd))] = zstd
    mblob = jdump(manifest)
    files[blob_path(sha(mblob))] = mblob
    files["index.json"] = jdump({"manifests": [{"mediaType": OCI_MANIFEST, "digest": sha(mblob), "size": len(mblob)}]})
    with pytest.raises(InvalidRequest, match="zstd-compressed"):
        read_image(write_dir(tmp_path / "oci2", files))


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="nothing to import"):
        read_image(tmp_path / "absent")
    (tmp_path / "junk").write_bytes(b"not an archive" * 100)
    with pytest.raises(InvalidRequest, match="neither a directory nor a readable tar archive"):
        read_image(tmp_path / "junk")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match="neither an OCI image layout"):
        read_image(tmp_path / "empty")
    img = build(layers=[L3], gz=(False,))
    files = layout([img.descriptor()], img)
    files["index.json"] = b'{"manifests": "nope"}'
    with pytest.raises(InvalidRequest, match=r"index\.json .* is not valid"):
        read_image(write_dir(tmp_path / "bad-index", files))
    files = layout([img.descriptor(digest="sha512:" + "0" * 128)], img)
    with pytest.raises(InvalidRequest, match="sha512, which is not supported"):
        read_image(write_dir(tmp_path / "sha512", files))


def test_layout_blob_symlink_cannot_escape(tmp_path: Path, outside: Path) -> None:
    """A layout is user input too: a blob symlinked out of it resolves inside the layout, not on the host."""
    img = build(layers=[L3], gz=(False,))
    src = write_dir(tmp_path / "oci", layout([img.descriptor()], img))
    blob = src / blob_path(sha(img.blobs[0]))
    (outside / "layer").write_bytes(img.blobs[0])
    blob.unlink()
    blob.symlink_to(outside / "layer")  # absolute: resolved with the layout as "/"
    with pytest.raises(InvalidRequest, match="is missing from"):
        read_image(src)


@needs_root
def test_nonempty_destination_refused(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "leftover").write_bytes(b"")
    with pytest.raises(InvalidRequest, match="is not empty"):
        extract_layer(raw_layer(tmp_path, make_tar([reg("a", b"a")])), dest)


@needs_root
def test_wrong_diff_id_refused_on_extraction(tmp_path: Path) -> None:
    img = build(layers=[L3], gz=(True,))
    cfg = json.loads(img.config)
    cfg["rootfs"]["diff_ids"] = [sha(b"something else")]
    img.config = jdump(cfg)
    img.manifest = jdump(
        {
            **json.loads(img.manifest),
            "config": {"mediaType": OCI_CONFIG, "digest": sha(img.config), "size": len(img.config)},
        }
    )
    image = read_image(write_dir(tmp_path / "oci", layout([img.descriptor()], img)))  # blob digests are fine
    with pytest.raises(InvalidRequest, match="does not match diff_id"):
        extract_layer(image.layers[0], tmp_path / "dest")


@needs_root
def test_huge_extended_header_refused(tmp_path: Path) -> None:
    data = make_tar([reg("a", b"a", pax_headers={"comment": "x" * (17 << 20)})])
    with pytest.raises(InvalidRequest, match=r"extended header of \d+ bytes is over the limit"):
        extract_layer(raw_layer(tmp_path, data), tmp_path / "dest")


@needs_root
def test_zstd_layer_imported(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")  # a dependency of dsec: under CI this must not skip
    tar = make_tar([reg("etc/zstd.txt", b"squeezed\n" * 100)])
    layer = raw_layer(tmp_path, zstandard.ZstdCompressor().compress(tar), "zstd")
    extract_layer(layer, tmp_path / "dest")
    assert (tmp_path / "dest/etc/zstd.txt").read_bytes() == b"squeezed\n" * 100
