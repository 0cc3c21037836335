"""Push (issue 21, item 5): a dsec image (a pack_diff snapshot, with a file deleted from its base) written
to a real docker-registry on loopback runs under podman as it ran in dsec; a second push sends nothing
new; the image pulls back into dsec; the errors a user sees. podman runs the pushed image with its own
storage, so the host's is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, own_daemon, scratch_dir
from .registry import Registry, need, start_registry

# /bin/vi was deleted (a whiteout); /data was replaced by a directory of its own over one a lower layer
# filled (an opaque directory)
CHECK = (
    'cat /work/note && test ! -e /bin/vi && test ! -L /bin/vi && test "$(ls /data)" = c '
    "&& test -x /work/run.sh && /work/run.sh"
)


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name: this module runs a daemon of its own."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with scratch_dir("dsec-push-") as path:
        yield path


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[Registry]:
    found = start_registry(workdir / "registry")
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def node(workdir: Path, registry: Registry) -> Iterator[Daemon]:
    with own_daemon(workdir) as d:
        yield d


def podman(workdir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """podman with storage of its own under ``workdir`` (the host's images and containers untouched)."""
    root = workdir / "podman"
    argv = [need("podman"), "--root", str(root / "root"), "--runroot", str(root / "run")]
    argv += ["--cgroup-manager=cgroupfs", "--events-backend=file", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def snapshot(node: Daemon) -> str:
    """Two snapshots deep: the first fills /data, the second replaces it and deletes a file of the base."""
    client = node.client()
    with dsec.Sandbox.create(image="dsec/busybox", client=client, timeout=300) as sb:
        assert sb.exec("mkdir /data && touch /data/a /data/b").exit_code == 0
        sb.snapshot("pushed/base:1")
    with dsec.Sandbox.create(image="pushed/base:1", client=client, timeout=300) as sb:
        setup = sb.exec("mkdir -p /work && echo made in dsec > /work/note && rm /bin/vi && rm -r /data && mkdir /data")
        assert setup.exit_code == 0, setup
        assert sb.exec("touch /data/c").exit_code == 0
        sb.files.write("/work/run.sh", "#!/bin/sh\necho ran the task\n")
        assert sb.exec("chmod 755 /work/run.sh").exit_code == 0
        assert sb.exec(CHECK).stdout == "made in dsec\nran the task\n"
        sb.snapshot("pushed/env:1")
    return "pushed/env:1"


def test_a_pushed_snapshot_runs_under_podman_as_it_ran_in_dsec(
    node: Daemon, registry: Registry, snapshot: str, workdir: Path
) -> None:
    client = node.client()
    ref = f"{registry.host}/pushed/env:1"
    result = client.push(snapshot, ref)
    assert result.layers == len(client.image(snapshot).layers) >= 3
    assert result.layers_uploaded == result.layers and result.bytes_uploaded > 0
    assert result.reference == f"{ref}@{result.digest}"
    pulled = podman(workdir, "pull", "--tls-verify=false", "--quiet", ref)
    assert pulled.returncode == 0, pulled.stderr
    # podman asks crun for limits above what root without CAP_SYS_RESOURCE may set (so here): lower ones
    limits = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    ran = podman(workdir, "run", "--rm", "--network", "none", *limits, ref, "/bin/sh", "-c", CHECK)
    assert (ran.returncode, ran.stdout) == (0, "made in dsec\nran the task\n"), ran.stderr

    again = client.push(snapshot, f"{registry.host}/pushed/env:2")
    assert again.layers_uploaded == 0 and again.digest == result.digest  # the same image, nothing sent


def test_a_pushed_image_pulls_back_into_dsec(node: Daemon, registry: Registry, snapshot: str) -> None:
    client = node.client()
    ref = f"{registry.host}/pushed/back:1"
    client.push(snapshot, ref)
    with dsec.Sandbox.create(image=ref, client=client, timeout=300) as sb:
        res = sb.exec(CHECK)
        assert (res.exit_code, res.stdout) == (0, "made in dsec\nran the task\n"), res


def test_push_errors_are_clear(node: Daemon, registry: Registry, snapshot: str) -> None:
    client = node.client()
    with pytest.raises(dsec.ImageNotFound):
        client.push("pushed/none:1", f"{registry.host}/pushed/none:1")
    with pytest.raises(dsec.InvalidRequest, match="tag"):
        client.push(snapshot, f"{registry.host}/pushed/env@sha256:{'0' * 64}")
    with pytest.raises(dsec.RegistryUnreachable):
        client.push(snapshot, "127.0.0.1:1/pushed/env:1")


def test_dsec_image_push_on_the_command_line(node: Daemon, registry: Registry, snapshot: str) -> None:
    env = {**os.environ, "DSEC_URL": node.url, "DSEC_TOKEN": node.token}
    ref = f"{registry.host}/pushed/cli:1"
    out = subprocess.run(
        [sys.executable, "-m", "dsec", "image", "push", snapshot, ref],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert ref in out.stdout and "uploaded" in out.stdout
