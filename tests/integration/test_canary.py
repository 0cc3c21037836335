"""Canary residue scanner on every image publish: snapshots, builds and the daemon's --canary.

Each refused publish must name the layer and path without echoing the canary, and leave no image
version behind; the same content without canaries publishes as before (the control).
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec
from dsec.protocol.build import ImageSpec

from .conftest import Daemon, shut_down, start_daemon


def unique(prefix: str) -> str:
    return f"test/{prefix}:{secrets.token_hex(4)}"


def canary() -> str:
    return "CANARY-" + secrets.token_hex(8)


def _refused(excinfo: pytest.ExceptionInfo[dsec.ResidueFound], secret: str, path: str) -> str:
    message = str(excinfo.value)
    assert secret not in message and secret not in str(excinfo.value.detail)
    assert path in message, message
    layer = re.search(r"layer ([0-9a-f]{64})", message)
    assert layer is not None, message
    return layer.group(1)


def _absent(client: dsec.Client, name: str) -> None:
    with pytest.raises(dsec.ImageNotFound):
        client.image(name)


def test_canary_in_contents_and_names_blocks_a_snapshot(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    client = daemon.client()
    secret = canary()
    sb = make_sandbox()
    sb.exec(f"mkdir -p /work && echo 'the answer: {secret}' > /work/answers.txt", user="root")
    name = unique("canary-content")
    with pytest.raises(dsec.ResidueFound) as excinfo:
        sb.snapshot(name, canaries=[secret])
    _refused(excinfo, secret, "/work/answers.txt")
    _absent(client, name)

    sb2 = make_sandbox()
    sb2.exec(f"mkdir -p /work && touch '/work/{secret}.key'", user="root")
    with pytest.raises(dsec.ResidueFound) as excinfo:
        sb2.snapshot(name, canaries=["unrelated-canary", secret])
    _refused(excinfo, secret, "/work/<canary>.key")
    _absent(client, name)

    # the control: without canaries the same sandbox publishes as before
    info = sb.snapshot(name)
    assert client.image(name).digest == info.digest


def test_canary_across_a_read_buffer_boundary(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    secret = canary()
    sb = make_sandbox()
    head = (1 << 20) - len(secret) // 2  # the canary straddles the scanner's first 1 MiB read
    sb.files.write("/blob.bin", b"\0" * head + secret.encode() + b"\0" * 4096)
    name = unique("canary-split")
    with pytest.raises(dsec.ResidueFound) as excinfo:
        sb.snapshot(name, canaries=[secret])
    _refused(excinfo, secret, "/blob.bin")
    _absent(daemon.client(), name)


def test_canary_hidden_by_a_whiteout_is_still_found(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    client = daemon.client()
    secret = canary()
    first = make_sandbox()
    first.exec(f"mkdir -p /work && echo {secret} > /work/solution.txt", user="root")
    lower = first.snapshot(unique("canary-lower"))  # published: nobody asked for this canary yet
    second = make_sandbox(image=lower.name)
    second.exec("rm /work/solution.txt", user="root")
    assert second.exec("ls /work").stdout == ""
    name = unique("canary-whiteout")
    with pytest.raises(dsec.ResidueFound) as excinfo:
        second.snapshot(name, canaries=[secret])
    layer = _refused(excinfo, secret, "/work/solution.txt")
    assert layer == lower.layers[-1].digest  # found in the lower layer, under the new layer's whiteout
    _absent(client, name)


def test_canary_written_by_a_build_step_fails_the_build(daemon: Daemon) -> None:
    client = daemon.client()
    secret = canary()
    spec = ImageSpec("dsec/busybox").run("mkdir -p /opt/task && echo " + secret + " > /opt/task/expected")
    name = unique("canary-build")
    with pytest.raises(dsec.ResidueFound) as excinfo:
        client.build(spec, name, canaries=[secret])
    _refused(excinfo, secret, "/opt/task/expected")
    _absent(client, name)
    assert client.build(spec, name).image.name == name  # the control


def test_daemon_canaries_apply_to_every_publish(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    secret = canary()
    state = Path(tempfile.mkdtemp(prefix="dsec-canary-"))
    node = start_daemon(state, "--canary", secret)
    try:
        client = node.client()
        with dsec.Sandbox.create(image="dsec/debian:12", client=client) as sb:
            clean = sb.snapshot(unique("canary-node-clean"))  # the base layer is scanned once here
            sb.exec(f"echo {secret} > /root/notes", user="root")
            name = unique("canary-node")
            with pytest.raises(dsec.ResidueFound) as excinfo:
                sb.snapshot(name)
            _refused(excinfo, secret, "/root/notes")
            _absent(client, name)
        assert clean.digest
        scans = re.findall(
            r"canary scan of layer (\w+): (\d+) files, (\d+) bytes, (\d+) hits in ([\d.]+)s", node.log.read_text()
        )
        print("\n[canary] scans on this node:", scans)
        assert scans
        with pytest.raises(RuntimeError, match="a canary must be 8 to 4096 characters"):  # refused at start
            start_daemon(state / "refusing", "--canary", "short")
    finally:
        shut_down(node)
        shutil.rmtree(state, ignore_errors=True)
