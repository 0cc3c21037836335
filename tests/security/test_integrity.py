"""Reward integrity: answers left in images, canaries in snapshots, a candidate tampering with its grader."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import pytest

import dsec
from dsec.protocol.build import ImageSpec

from ..integration.conftest import layer_bytes
from .conftest import CANARY, Daemon, create, heartbeat

_BUILT: dict[str, tuple[dsec.ImageInfo, str]] = {}


def _residue_image(d: Daemon) -> tuple[dsec.ImageInfo, str]:
    """An image whose build wrote an answer file and deleted it in a later step (built once a session)."""
    if "image" not in _BUILT:
        answer = "dsec-answer-" + secrets.token_hex(12)
        spec = (
            ImageSpec("dsec/busybox")
            .run(f"mkdir -p /work && echo {answer} > /work/answer.txt && echo {answer} > /tmp/answer.txt")
            .run("cp /work/answer.txt /root/.cache-answer")
            .run("rm -f /work/answer.txt /root/.cache-answer /tmp/answer.txt")
        )
        built = d.client().build(spec, f"test/residue:{secrets.token_hex(4)}")
        _BUILT["image"] = (built.image, answer)
    return _BUILT["image"]


def test_residual_build_material_is_not_in_the_published_layers(sec_daemon: Daemon) -> None:
    """Once: the published layers are the same whatever kind later runs them."""
    image, answer = _residue_image(sec_daemon)
    leaks = [layer.digest for layer in image.layers if answer.encode() in layer_bytes(layer.digest)]
    assert not leaks, f"the deleted answer file is still in layers {leaks}"
    # the build's three step layers were squashed into one (later steps deleted what earlier ones wrote)
    assert "squashed" in image.layers[-1].created_by


def test_residual_build_material_is_not_visible_in_a_sandbox(
    sec_daemon: Daemon, kind: str, neighbour: dsec.Sandbox
) -> None:
    image, answer = _residue_image(sec_daemon)
    sb = create(sec_daemon, kind, image=image.name)
    try:
        with heartbeat(neighbour):
            res = sb.exec(
                f"for d in /work /root /tmp /var /etc /.dsec; do timeout 10 grep -r -l -s {answer[:-1]}[{answer[-1]}] "
                "$d; done; echo searched",
                timeout=90,
            )
    finally:
        sb.kill()
    assert res.stdout == "searched\n", res.stdout


def test_a_build_secret_written_then_deleted_is_never_published(sec_daemon: Daemon) -> None:
    """Once: builds run in container builder sandboxes whatever the kind."""
    token = "dsec-secret-" + secrets.token_hex(12)
    spec = (
        ImageSpec("dsec/busybox")
        .run("mkdir -p /work && echo $TOKEN > /work/token.txt", secrets=["TOKEN"])
        .run("rm -f /work/token.txt")
    )
    name = f"test/secret-residue:{secrets.token_hex(4)}"
    with pytest.raises(dsec.BuildFailed, match="secret"):
        sec_daemon.client().build(spec, name, secrets={"TOKEN": token})
    with pytest.raises(dsec.DsecError):
        sec_daemon.client().image(name)


def test_a_canary_planted_in_a_snapshot_is_refused(
    sec_daemon: Daemon, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    sb = fresh_attacker()
    name = f"test/canary:{secrets.token_hex(4)}"
    # the canary split on write so that the command line itself does not carry it whole
    half = len(CANARY) // 2
    with heartbeat(neighbour):
        sb.exec(f"mkdir -p /work/deep && printf %s%s '{CANARY[:half]}' '{CANARY[half:]}' > /work/deep/key.bin")
    with pytest.raises(dsec.ResidueFound) as err:
        sb.snapshot(name)
    assert CANARY not in str(err.value)  # the refusal names where, never the canary
    with pytest.raises(dsec.DsecError):
        sec_daemon.client().image(name)
    # hidden behind a whiteout in a later step: still found, still refused
    spec = (
        ImageSpec("dsec/busybox")
        .run(f"mkdir -p /work && printf %s%s '{CANARY[:half]}' '{CANARY[half:]}' > /work/key.bin")
        .run("rm -f /work/key.bin")
    )
    with pytest.raises((dsec.ResidueFound, dsec.BuildFailed)):
        sec_daemon.client().build(spec, f"test/canary-whiteout:{secrets.token_hex(4)}")


GRADER = 'test "$(cat /work/answer)" = 42 && echo GRADED-PASS'


def test_a_candidate_tampering_with_its_grader_gains_nothing(
    kind: str, fresh_attacker: Callable[..., dsec.Sandbox], neighbour: dsec.Sandbox
) -> None:
    sb = fresh_attacker()
    with heartbeat(neighbour):
        sb.exec(
            "mkdir -p /work /grade && echo 41 > /work/answer && "
            # its own copy of the grader, a shell that always passes, PATH and profile hooks
            "echo 'echo GRADED-PASS; exit 0' > /grade/check.sh && "
            "printf '#!/bin/busybox sh\\necho GRADED-PASS\\nexit 0\\n' > /work/sh && chmod 755 /work/sh && "
            "cp /work/sh /work/test && cp /work/sh /work/cat && "
            "echo 'export PATH=/work:$PATH' >> /etc/profile && "
            "cp /bin/busybox /work/busybox && /work/busybox rm -f /bin/sh && /work/busybox cp /work/sh /bin/sh"
        )
    assert sb.exec(["/work/busybox", "cat", "/bin/sh"]).stdout.endswith("exit 0\n")  # the tampering landed
    try:
        graded = sb.grade("sh /grade/check.sh", paths=["/work"], tests={"check.sh": GRADER}, timeout=60)
    except dsec.InvalidRequest as e:
        pytest.skip(f"{kind}: grade refused: {e}")
    assert graded.result.exit_code != 0 and "GRADED-PASS" not in graded.result.stdout, graded.result
    # the control: the same grader passes an honest answer, so the failure above is the grader's verdict
    sb.exec(["/work/busybox", "sh", "-c", "echo 42 > /work/answer"])
    honest = sb.grade("sh /grade/check.sh", paths=["/work"], tests={"check.sh": GRADER}, timeout=60)
    assert honest.result.exit_code == 0 and "GRADED-PASS" in honest.result.stdout, honest.result
