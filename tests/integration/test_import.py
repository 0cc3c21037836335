"""Importing images users already have: an OCI layout and a docker-save tarball become dsec images."""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import shutil
import tarfile
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, layer_bytes


def _member(
    tar: tarfile.TarFile,
    name: str,
    data: bytes | None = None,
    *,
    mode: int = 0o644,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _layer(build: object) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        build(tar)  # type: ignore[operator]
    return buf.getvalue()


def base_layer(tar: tarfile.TarFile) -> None:
    busybox = shutil.which("busybox")
    assert busybox is not None
    for d in ("bin", "etc", "opt", "root", "tmp"):
        _member(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
    _member(tar, "bin/busybox", Path(busybox).read_bytes(), mode=0o755)
    for applet in ("sh", "cat", "ls", "pwd"):
        _member(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox")
    _member(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    _member(tar, "etc/config", b"v1\n")
    _member(tar, "opt/gone", b"x\n")
    _member(tar, "root/.bash_history", b"hist-secret-77\n")


def top_layer(tar: tarfile.TarFile) -> None:
    _member(tar, "etc/config", b"v2\n")
    _member(tar, "opt/.wh.gone", b"")
    _member(tar, "root/.wh..bash_history", b"")


def oci_layout(root: Path) -> Path:
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layers = [_layer(base_layer), _layer(top_layer)]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin", "FOO=bar"], "WorkingDir": "/opt"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(x).hexdigest()}" for x in layers]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(json.dumps(config).encode())},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(x)} for x in layers],
    }
    index = {
        "schemaVersion": 2,
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(json.dumps(manifest).encode())}
        ],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


def test_import_oci_layout_and_tarball(daemon: Daemon, tmp_path: Path) -> None:
    client = daemon.client()
    layout = oci_layout(tmp_path / "layout")
    name = f"test/imported:{secrets.token_hex(4)}"
    info = client.import_image(layout, name)
    assert [layer.role for layer in info.layers] == ["base", "toolkit"]
    assert "root/.bash_history" in info.scrubbed
    with dsec.Sandbox.create(image=name, client=client) as sb:
        out = sb.exec("pwd; cat /etc/config; echo $FOO; ls /opt; ls -a /root")
        # /opt/gone is whited out and /root/.bash_history both whited out and scrubbed
        assert out.stdout.split() == ["/opt", "v2", "bar", ".", ".."]
    # residue is gone from the layer that carried it, not only hidden by the later whiteout
    assert b"hist-secret-77" not in layer_bytes(info.layers[0].digest)

    tarball = tmp_path / "image.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(layout, arcname=".")
    again = client.import_image(tarball, f"test/imported:{secrets.token_hex(4)}")
    assert [x.size for x in again.layers] == [x.size for x in info.layers]
    with dsec.Sandbox.create(image=again.name, client=client) as sb:
        assert sb.exec("cat /etc/config").stdout == "v2\n"


def test_import_errors(daemon: Daemon, tmp_path: Path) -> None:
    client = daemon.client()
    with pytest.raises(dsec.InvalidRequest, match="nothing to import"):
        client.import_image(tmp_path / "missing", "test/x:1")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(dsec.InvalidRequest):
        client.import_image(garbage, f"test/x:{secrets.token_hex(4)}")
    layout = oci_layout(tmp_path / "layout")
    blob = next((layout / "blobs" / "sha256").iterdir())
    blob.write_bytes(blob.read_bytes() + b"tampered")
    with pytest.raises(dsec.InvalidRequest, match=r"descriptor|digest"):
        client.import_image(layout, f"test/x:{secrets.token_hex(4)}")
