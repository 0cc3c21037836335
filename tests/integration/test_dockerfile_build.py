"""Dockerfile builds end to end (issue 21, item 4): a Terminal-Bench-style task whose base comes from a
real docker-registry on loopback, built with RUN, COPY (--from, --chown), ADD of a local archive, WORKDIR,
USER, ENV, ARG, a secret and .dockerignore, then its check run inside a sandbox of the result; the build
cache, the CLI, and the errors a user sees. The base holds the host's static busybox with its applets."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon, layer_bytes, own_daemon, scratch_dir
from .pull_images import M, make_layer, tar_of
from .registry import OciLayout, Registry, push, start_registry

BUSYBOX = Path("/bin/busybox")

DOCKERFILE = """\
# a task image: a tool built in one stage, the task and its check in the other
ARG BASE
FROM ${BASE} AS builder
WORKDIR /src
COPY tool.sh ./
RUN sh ./tool.sh > /src/artifact

FROM ${BASE}
ARG FLAVOUR=plain
ENV GREETING="hello world" APP=/app
WORKDIR $APP
COPY --from=builder /src/artifact ./artifact
COPY --chown=agent:agent tests/ tests/
ADD bundle.tar.gz /opt/
RUN --mount=type=secret,id=token,env=TOKEN test "$TOKEN" = s3cret-value && echo "$FLAVOUR" > flavour
RUN mkdir -p /home/agent && chown agent:agent /home/agent
USER agent
WORKDIR /home/agent
RUN echo "$GREETING from $(id -un)" > made-by
EXPOSE 8080
LABEL task=demo
CMD ["/bin/sh", "/app/tests/check.sh"]
"""

CHECK = """\
set -e
test "$(cat /app/artifact)" = "built by tool"
test "$(cat /app/flavour)" = "spicy"
test "$(stat -c %U /app/tests/check.sh)" = agent
test "$(cat /opt/bundle/data.txt)" = "from the bundle"
test "$(cat /home/agent/made-by)" = "hello world from agent"
test ! -e /app/ignored.txt && test ! -e /run/secrets/token
test "$(id -un)" = agent && test "$PWD" = /home/agent
echo all checks passed
"""


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name: this module runs a daemon of its own."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with scratch_dir("dsec-dockerfile-") as path:
        yield path


def busybox_layer() -> bytes:
    """/bin/busybox with a link per applet, and an agent account."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    members = [M("bin", kind=tarfile.DIRTYPE, mode=0o755), M("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)]
    members += [M(f"bin/{a}", kind=tarfile.SYMTYPE, link="busybox") for a in applets if a != "busybox"]
    members += [
        M("etc", kind=tarfile.DIRTYPE, mode=0o755),
        M("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"),
        M("etc/group", b"root:x:0:\nagent:x:1000:\n"),
        M("tmp", kind=tarfile.DIRTYPE, mode=0o1777),
    ]
    return tar_of(members)


@contextlib.contextmanager
def busybox_registry(where: Path) -> Iterator[Registry]:
    """A registry on loopback holding base/busybox:1, a base image to build FROM; stopped after."""
    found = start_registry(where / "registry")
    layout = OciLayout(where / "layout")
    layout.name(layout.image([make_layer(busybox_layer())]), "1")
    push(layout, "1", found, "base/busybox:1")
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[Registry]:
    with busybox_registry(workdir) as found:
        yield found


@pytest.fixture(scope="module")
def node(workdir: Path, registry: Registry) -> Iterator[Daemon]:
    with own_daemon(workdir) as d:
        yield d


@pytest.fixture(scope="module")
def context(workdir: Path) -> Path:
    ctx = workdir / "task"
    (ctx / "tests").mkdir(parents=True)
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "tool.sh").write_text("echo built by tool\n")
    (ctx / "tests" / "check.sh").write_text(CHECK)
    (ctx / "ignored.txt").write_text("must not reach the image")
    (ctx / ".dockerignore").write_text("ignored.txt\n")
    bundle = io.BytesIO()
    with tarfile.open(fileobj=bundle, mode="w") as tar:
        data = b"from the bundle"
        info = tarfile.TarInfo("bundle/data.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (ctx / "bundle.tar.gz").write_bytes(gzip.compress(bundle.getvalue()))
    return ctx


def build(client: dsec.Client, registry: Registry, context: Path, name: str) -> dsec.BuildResult:
    return client.build_dockerfile(
        name,
        context,
        build_args={"BASE": f"{registry.host}/base/busybox:1", "FLAVOUR": "spicy"},
        secrets={"token": "s3cret-value"},
    )


def test_a_task_image_builds_from_a_registry_base_and_its_check_passes(
    node: Daemon, registry: Registry, context: Path
) -> None:
    client = node.client()
    result = build(client, registry, context, "tasks/demo:1")
    described = [s.description for s in result.steps]
    assert len(described) == 8 and all(not s.cached for s in result.steps), described
    assert described[0].startswith("builder: line 5: COPY tool.sh")
    with dsec.Sandbox.create(image="tasks/demo:1", client=client, timeout=300) as sb:
        res = sb.exec(["/bin/sh", "/app/tests/check.sh"])
        assert (res.exit_code, res.stdout.strip()) == (0, "all checks passed"), res
        assert sb.exec("id -un; pwd").stdout.split() == ["agent", "/home/agent"]
    for layer in result.image.layers:  # the secret reached the command, never a layer
        assert b"s3cret-value" not in layer_bytes(layer.digest, node.state_dir.parent / "repository")
    assert client.list() == []  # every builder sandbox is gone


def test_a_rebuild_is_all_cache_and_a_changed_file_rebuilds_from_there(
    node: Daemon, registry: Registry, context: Path, workdir: Path
) -> None:
    client = node.client()
    again = build(client, registry, context, "tasks/demo:2")
    assert all(s.cached for s in again.steps), [s.description for s in again.steps if not s.cached]
    changed = workdir / "task2"
    shutil.copytree(context, changed)
    (changed / "tests" / "check.sh").write_text(CHECK + "# changed\n")
    third = build(client, registry, changed, "tasks/demo:3")
    fresh = [s.description.split(": ", 2)[2] for s in third.steps if not s.cached]
    assert fresh[0].startswith("COPY --chown=agent:agent tests/") and len(fresh) == 5, fresh


@pytest.mark.parametrize(
    ("dockerfile", "error", "message"),
    [
        ("FROM {base}\nRUN exit 3\n", dsec.BuildFailed, "line 2 .*exited with status 3"),
        ("FROM {base}\nHEALTHCHECK CMD true\n", dsec.InvalidRequest, "line 2: HEALTHCHECK is not supported"),
        ("FROM {base}\nCOPY nowhere /x\n", dsec.InvalidRequest, "'nowhere' not found in the build context"),
        ("FROM {base}\nRUN --mount=type=secret,id=absent,required=true true\n", dsec.InvalidRequest, "absent"),
        ("FROM {base}\nUSER nobody-here\nRUN true\n", dsec.BuildFailed, "line 3"),
        ("FROM {host}/base/none:1\n", dsec.ImageNotFound, "none"),
    ],
)
def test_errors_name_the_line_and_leave_nothing_behind(
    node: Daemon, registry: Registry, workdir: Path, dockerfile: str, error: type[Exception], message: str
) -> None:
    client = node.client()
    ctx = workdir / "bad"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(dockerfile.format(base=f"{registry.host}/base/busybox:1", host=registry.host))
    with pytest.raises(error, match=message):
        client.build_dockerfile("tasks/bad:1", ctx)
    with pytest.raises(dsec.ImageNotFound):
        client.image("tasks/bad:1")
    assert client.list() == []


def test_docker_build_on_the_command_line(node: Daemon, registry: Registry, context: Path) -> None:
    env = {**os.environ, "DSEC_URL": node.url, "DSEC_TOKEN": node.token, "TOKEN": "s3cret-value"}
    args = ["--build-arg", f"BASE={registry.host}/base/busybox:1", "--build-arg", "FLAVOUR=spicy"]
    args += ["-t", "tasks/cli:1", "--secret", "id=token,env=TOKEN", "--target", "builder"]
    out = subprocess.run(
        [sys.executable, "-m", "dsec", "image", "build", "-f", str(context / "Dockerfile"), str(context), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "tasks/cli:1" in out.stdout
    client = node.client()
    with dsec.Sandbox.create(image="tasks/cli:1", client=client, timeout=300) as sb:
        assert sb.exec(["/bin/cat", "/src/artifact"]).stdout == "built by tool\n"  # the builder stage only
        assert sb.exec(["/bin/ls", "/app"]).exit_code != 0
    bad = subprocess.run(
        [sys.executable, "-m", "dsec", "image", "build", str(context)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "-t NAME:TAG" in bad.stderr and "Traceback" not in bad.stderr
