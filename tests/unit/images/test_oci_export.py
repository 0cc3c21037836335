"""A layer in overlayfs's format written as an OCI layer tar (oci_export.py): whiteouts and opaque
directories turned back into .wh. entries, hard links, symlinks, modes, owners and xattrs kept, digests of
both the blob and the tar; and the config and manifest documents a push writes."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsec.images.model import ImageConfig
from dsec.images.oci_export import config_document, export_layer, manifest_document

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are 0/0 character devices: mknod needs root")


@needs_root
def test_a_layer_exports_with_docker_s_whiteouts(tmp_path: Path) -> None:
    root = tmp_path / "layer"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "conf").write_text("x=1\n")
    os.link(root / "etc" / "conf", root / "etc" / "conf.bak")
    (root / "bin").mkdir()
    (root / "bin" / "sh").symlink_to("busybox")
    os.mknod(root / "etc" / "gone", stat.S_IFCHR, os.makedev(0, 0))
    (root / "data").mkdir()
    os.setxattr(root / "data", "trusted.overlay.opaque", b"y")
    (root / "data" / "new").write_bytes(b"\x00\x01")
    os.chown(root / "data" / "new", 1000, 1000)  # before the chmod: a chown clears the setuid bit
    os.chmod(root / "data" / "new", 0o4755)
    os.setxattr(root / "data" / "new", "user.note", b"kept")

    out = io.BytesIO()
    exported = export_layer(root, out)
    blob = out.getvalue()
    assert exported.digest == "sha256:" + hashlib.sha256(blob).hexdigest() and exported.size == len(blob)
    plain = gzip.decompress(blob)
    assert exported.diff_id == "sha256:" + hashlib.sha256(plain).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        members = {m.name: m for m in tar}
        assert "etc/.wh.gone" in members and members["etc/.wh.gone"].isreg()
        assert "etc/gone" not in members
        assert "data/.wh..wh..opq" in members
        links = [members["etc/conf"], members["etc/conf.bak"]]
        assert sorted(m.islnk() for m in links) == [False, True]
        assert members["bin/sh"].issym() and members["bin/sh"].linkname == "busybox"
        new = members["data/new"]
        assert (new.mode, new.uid, new.gid) == (0o4755, 1000, 1000)
        assert new.pax_headers.get("SCHILY.xattr.user.note") == "kept"
        assert not any("trusted.overlay" in k for m in members.values() for k in m.pax_headers)


def test_config_and_manifest_documents() -> None:
    config = ImageConfig(
        env={"PATH": "/bin", "A": "b=c"},
        workdir="/w",
        user="1000",
        entrypoint=["/bin/sh"],
        cmd=["-c", "x"],
        labels={"k": "v"},
        exposed_ports=["80/tcp"],
    )
    doc = config_document(config, ["sha256:" + "a" * 64], "2026-12-05T00:00:00Z", ["built"])
    parsed = json.loads(doc)
    assert parsed["config"] == {
        "Env": ["PATH=/bin", "A=b=c"],
        "WorkingDir": "/w",
        "User": "1000",
        "Entrypoint": ["/bin/sh"],
        "Cmd": ["-c", "x"],
        "Labels": {"k": "v"},
        "ExposedPorts": {"80/tcp": {}},
    }
    assert parsed["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + "a" * 64]}
    assert (parsed["os"], parsed["architecture"]) == ("linux", "amd64")
    manifest = json.loads(manifest_document(doc, []))
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(doc).hexdigest()
    assert manifest["config"]["size"] == len(doc) and manifest["schemaVersion"] == 2
