"""Finding an image's own init in its stacked layers, as overlayfs would show them to the guest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.kinds.vm import image_init


def layer(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    return path


def executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def test_debian_style_links_across_layers(tmp_path: Path) -> None:
    base, top = layer(tmp_path, "base"), layer(tmp_path, "top")
    (base / "sbin").symlink_to("usr/sbin")  # merged /usr
    (base / "usr/sbin").mkdir(parents=True)
    executable(top / "usr/lib/systemd/systemd")
    (top / "usr/sbin").mkdir(parents=True)
    (top / "usr/sbin/init").symlink_to("../lib/systemd/systemd")
    assert image_init.find((base,)) is None
    assert image_init.find((base, top)) == "/sbin/init"


def test_absolute_links_resolve_inside_the_image(tmp_path: Path) -> None:
    only = layer(tmp_path, "only")
    executable(only / "bin/busybox")
    (only / "sbin").mkdir()
    (only / "sbin/init").symlink_to("/bin/busybox")  # on the host, /bin/busybox may not exist at all
    assert image_init.find((only,)) == "/sbin/init"


def test_the_kernels_order_and_no_shell(tmp_path: Path) -> None:
    only = layer(tmp_path, "only")
    executable(only / "bin/sh")
    assert image_init.find((only,)) is None  # the kernel's last resort is no init system
    executable(only / "bin/init")
    assert image_init.find((only,)) == "/bin/init"
    executable(only / "etc/init")
    assert image_init.find((only,)) == "/etc/init"


def test_not_executable_or_not_a_file_or_a_loop(tmp_path: Path) -> None:
    only = layer(tmp_path, "only")
    (only / "sbin/init").mkdir(parents=True)  # a directory
    (only / "etc").mkdir()
    (only / "etc/init").write_text("not executable\n")
    (only / "bin").mkdir()
    (only / "bin/init").symlink_to("init")  # a link to itself
    assert image_init.find((only,)) is None


def test_a_higher_file_ends_a_lower_directory(tmp_path: Path) -> None:
    base, top = layer(tmp_path, "base"), layer(tmp_path, "top")
    executable(base / "sbin/init")
    (top / "sbin").write_text("a file now\n")
    assert image_init.find((base, top)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts (0/0 devices) and trusted.* xattrs need root")
def test_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    base, mid, top = layer(tmp_path, "base"), layer(tmp_path, "mid"), layer(tmp_path, "top")
    executable(base / "sbin/init")
    (mid / "sbin").mkdir()
    os.mknod(mid / "sbin/init", 0o600 | 0o020000, os.makedev(0, 0))  # removed in mid
    assert image_init.find((base, mid)) is None
    executable(top / "sbin/init")
    assert image_init.find((base, mid, top)) == "/sbin/init"
    # an opaque /sbin in mid hides base's /sbin/init even without a whiteout for it
    other = layer(tmp_path, "other")
    (other / "sbin").mkdir()
    os.setxattr(other / "sbin", "trusted.overlay.opaque", b"y")
    assert image_init.find((base, other)) is None
