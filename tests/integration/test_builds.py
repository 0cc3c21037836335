"""Image builds end to end: steps as cached layers, builder vs runtime, secrets and residue never packed."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

import dsec
from dsec.protocol.build import ImageSpec

from .conftest import Daemon, layer_bytes, resolves


def unique(prefix: str) -> str:
    return f"test/{prefix}:{secrets.token_hex(4)}"


def blobs(info: dsec.ImageInfo) -> list[bytes]:
    return [layer_bytes(layer.digest) for layer in info.layers[1:]]


def test_build_steps_become_cached_layers(
    daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox], tmp_path: Path
) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "main.sh").write_text("echo from-repo\n")
    spec = (
        ImageSpec("dsec/busybox")
        .copy(tmp_path / "repo", "/work/repo")
        .run("echo built > /work/built && echo $MODE > /work/mode")
        .env(GREETING="hello")
        .workdir("/work")
    )
    client = daemon.client()
    first = client.build(spec, unique("built"), args={"MODE": "fast"})
    assert [s.cached for s in first.steps] == [False, False]
    image = first.image
    assert [layer.role for layer in image.layers] == ["base", "workspace", "workspace"]
    assert image.parent == client.image("dsec/busybox").digest
    sb = make_sandbox(image=image.name)
    out = sb.exec("pwd; sh repo/main.sh; cat built mode; echo $GREETING")
    assert out.stdout == "/work\nfrom-repo\nbuilt\nfast\nhello\n"
    # same inputs: every step is taken from the cache; another argument: the run step is rebuilt
    again = client.build(spec, unique("built"), args={"MODE": "fast"})
    assert all(s.cached for s in again.steps)
    assert [x.digest for x in again.image.layers] == [x.digest for x in image.layers]
    other = client.build(spec, unique("built"), args={"MODE": "slow"})
    assert [s.cached for s in other.steps] == [True, False]


def test_secrets_reach_only_the_steps_that_name_them_and_never_the_image(daemon: Daemon) -> None:
    client = daemon.client()
    token = "tok-" + secrets.token_hex(8)
    spec = (
        ImageSpec("dsec/busybox")
        .run("echo ${TOKEN:-unset} > /blind")
        .run('[ "$TOKEN" = "' + token + '" ] && echo used > /used', secrets=["TOKEN"])
    )
    built = client.build(spec, unique("secret"), secrets={"TOKEN": token})
    with dsec.Sandbox.create(image=built.image.name, client=client) as sb:
        assert sb.exec("cat /blind /used; echo ${TOKEN:-absent}").stdout == "unset\nused\nabsent\n"
    assert not any(token.encode() in blob for blob in blobs(built.image))
    leaky = ImageSpec("dsec/busybox").run("echo $TOKEN > /leak", secrets=["TOKEN"])
    with pytest.raises(dsec.BuildFailed, match="secret"):
        client.build(leaky, unique("leak"), secrets={"TOKEN": token})
    with pytest.raises(dsec.InvalidRequest, match="not given"):
        client.build(leaky, unique("leak"))


def test_residue_is_scrubbed_from_every_step_layer(daemon: Daemon) -> None:
    client = daemon.client()
    spec = (
        ImageSpec("dsec/busybox")
        .run(
            "mkdir -p /root /work && echo netrc-password > /root/.netrc && echo hist > /root/.ash_history "
            "&& echo junk > /tmp/junk && echo answer-key-99 > /work/answer"
        )
        # each step starts from scrubbed layers: residue never reaches a later step either
        .run("[ ! -e /root/.netrc ] && [ ! -e /tmp/junk ] && rm -f /root/.netrc")
        .scrub("work/answer")
    )
    built = client.build(spec, unique("scrub"))
    assert {"root/.netrc", "root/.ash_history", "tmp/junk", "work/answer"} <= set(built.image.scrubbed)
    for blob in blobs(built.image):
        for residue in (b"netrc-password", b"answer-key-99", b"junk\n"):
            assert residue not in blob


def test_failing_and_bad_builds(daemon: Daemon, tmp_path: Path) -> None:
    client = daemon.client()
    with pytest.raises(dsec.BuildFailed, match=r"exited with status 3.*boom"):
        client.build(ImageSpec("dsec/busybox").run("echo boom >&2; exit 3"), unique("fail"))
    with pytest.raises(dsec.ImageNotFound):
        client.build(ImageSpec("nobody/nothing:1").run("true"), unique("nobase"))
    with pytest.raises(dsec.InvalidRequest, match="exactly one of"):
        ImageSpec("dsec/busybox")._add(run="true", apt=["x"])
    with pytest.raises(dsec.InvalidRequest, match="invalid package"):
        ImageSpec("dsec/busybox").apt("--allow-unauthenticated")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(dsec.InvalidRequest, match="not valid TOML"):
        client.build(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('name = "test/x:1"\nfrom = "dsec/busybox"\ncolour = "blue"\n')
    with pytest.raises(dsec.InvalidRequest, match="colour"):
        client.build(unknown)
    taken = client.build(ImageSpec("dsec/busybox").run("true"), unique("taken")).image.name
    with pytest.raises(dsec.ImageExists):
        client.build(ImageSpec("dsec/busybox").run("true"), taken)


@pytest.mark.skipif(not resolves("deb.debian.org"), reason="no route to the Debian archive from this machine")
def test_spec_file_with_apt_pip_and_git_scrub_on_the_builder_network(daemon: Daemon, tmp_path: Path) -> None:
    spec = tmp_path / "env.toml"
    name = unique("apt")
    git = (
        "set -e; git config --global user.email b@x; git config --global user.name b; "
        "mkdir /repo; cd /repo; git init -q; echo ok > kept; git add kept; git commit -qm kept; "
        "echo answer-key > answer; git add answer; git commit -qm answer; git hash-object answer > /answer-sha; "
        "git reset -q --hard HEAD~1"
    )
    spec.write_text(
        f'name = "{name}"\nfrom = "dsec/debian:12"\nscrub_git = true\n\n'
        '[[steps]]\napt = ["python3-pip"]\n\n'
        '[[steps]]\npip = ["iniconfig==2.0.0"]\n\n'
        f"[[steps]]\nrun = {json.dumps(git)}\n"
    )
    client = daemon.client()
    built = client.build(spec)
    assert built.image.name == name
    assert [layer.role for layer in built.image.layers][-3:] == ["toolkit", "toolkit", "workspace"]
    assert any(p.startswith("var/lib/apt/lists/") for p in built.image.scrubbed)
    with dsec.Sandbox.create(image=name, client=client) as sb:
        assert sb.exec("python3 -c 'import iniconfig; print(iniconfig.__name__)'").stdout == "iniconfig\n"
        # the commit that was reset away is gone from the object store, not only from the history
        assert sb.exec("cat /repo/kept; git -C /repo log --format=%s").stdout == "ok\nkept\n"
        gone = sb.exec("git -C /repo cat-file -e $(cat /answer-sha)")
        assert gone.exit_code != 0
        # the runtime sandbox has no network: only its loopback
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]


def test_runtime_account_is_not_the_builder(daemon: Daemon) -> None:
    client = daemon.client()
    spec = (
        ImageSpec("dsec/busybox")
        .run(
            "id -u > /built-as && echo agent:x:1000:1000::/home/agent:/bin/sh >> /etc/passwd"
            " && echo agent:x:1000: >> /etc/group && mkdir -p /home/agent /work && chown 1000:1000 /home/agent /work"
        )
        .user("agent")
        .workdir("/work")
    )
    built = client.build(spec, unique("account"))
    with dsec.Sandbox.create(image=built.image.name, client=client) as sb:
        assert sb.exec("cat /built-as; id -u; id -g; echo $HOME; pwd").stdout == "0\n1000\n1000\n/home/agent\n/work\n"
        denied = sb.exec("echo x >> /etc/passwd")
        assert denied.exit_code != 0 and "Permission denied" in denied.stderr
        assert sb.exec("id -u", user="root").stdout == "0\n"
        # another account's exec gets that account's HOME, as docker exec -u gives, unless the call sets it
        assert sb.exec("echo $HOME", user="root").stdout == "/root\n"
        assert sb.exec("echo $HOME", user="root", env={"HOME": "/elsewhere"}).stdout == "/elsewhere\n"
        assert sb.exec("echo $HOME", user="agent").stdout == "/home/agent\n"
        sb.files.write("/work/from-api.txt", b"hi")
        assert sb.exec("stat -c %u /work/from-api.txt && echo more >> /work/from-api.txt").exit_code == 0
        assert sb.exec("stat -c %u /work/from-api.txt").stdout == "1000\n"
        with pytest.raises(dsec.InvalidRequest, match="not in the image"):
            sb.exec("true", user="nobody-here")
    broken = ImageSpec("dsec/busybox").run("true").user("ghost")
    ghost = client.build(broken, unique("ghost")).image.name
    with pytest.raises(dsec.InvalidRequest, match="ghost"):
        dsec.Sandbox.create(image=ghost, client=client)
