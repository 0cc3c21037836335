"""Stateful code execution (issue 22, item 2): ``sb.run_code`` keeps a context's variables between calls,
returns streams, the last expression's value, rich outputs and structured errors; a Jupyter kernel runs it
in dsec/code:1 (the built-in image, built by its Dockerfile on first use) and a plain interpreter where the
image has no ipykernel; every kind."""

from __future__ import annotations

import base64
import secrets
import shutil
import signal
import struct
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dsec
from dsec.protocol.build import ImageSpec
from dsec.protocol.code import CODE_IMAGE, MAX_CONTEXTS

from .conftest import Daemon, release_node, start_daemon

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def code_image(daemon: Daemon) -> str:
    """dsec/code:1 on the test repository: built once (about two minutes from Debian's and PyPI's packages),
    then found by every later daemon that shares the repository."""
    info = daemon.client().build_image(CODE_IMAGE)
    assert info.ready and info.name == CODE_IMAGE
    return CODE_IMAGE


def png_size(data: str) -> tuple[int, int]:
    raw = base64.b64decode(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", raw[:16]
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


@pytest.mark.timeout(1800)
def test_a_jupyter_context_keeps_state_and_returns_what_jupyter_shows(
    code_image: str, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    sb = make_sandbox(image=code_image, kind="container")
    first = sb.run_code("import numpy as np\nx = np.arange(10)\ny = int(x.sum())")
    assert first.engine == "jupyter" and first.error is None and first.result is None
    r = sb.run_code("print('out'); import sys; print('err', file=sys.stderr); y * 2")
    assert (r.stdout, r.stderr, r.text) == ("out\n", "err\n", "90")
    assert r.execution_count > first.execution_count and r.context == "default"

    plot = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('squares')\nplt.show()")
    assert plot.error is None and len(plot.images) == 1
    width, height = png_size(plot.images[0])
    assert width > 100 and height > 100

    frame = sb.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert frame.result is not None and "<table" in frame.result["text/html"]
    assert frame.text is not None and frame.text.split() == ["a", "b", "0", "1", "3", "1", "2", "4"]

    failed = sb.run_code("def f(d):\n    return d['missing']\nf({})")
    assert failed.error is not None and failed.error.name == "KeyError" and failed.error.value == "'missing'"
    assert any("return d['missing']" in line for line in failed.error.traceback), failed.error.traceback
    assert not any("\x1b[" in line for line in failed.error.traceback)  # no terminal colours

    # the timeout interrupts the cell, and the context lives on with what it had
    slow = sb.run_code("import time\nz = 1\ntime.sleep(60)\nz = 2", timeout=2)
    assert slow.error is not None and slow.error.name == "TimeoutError" and "kept" in slow.error.value
    assert slow.duration < 30
    assert sb.run_code("(y, z)").text == "(45, 1)"


def test_contexts_are_separate_and_can_be_removed(code_image: str, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image=code_image, kind="container")
    sb.run_code("v = 'default'")
    sb.run_code("v = 'other'", context="other")
    assert sb.run_code("v").text == "'default'"
    assert sb.run_code("v", context="other").text == "'other'"
    assert sorted(sb.code_contexts()) == ["default", "other"]
    sb.remove_code_context("other")
    assert sb.code_contexts() == ["default"]
    again = sb.run_code("v", context="other")  # the name starts afresh
    assert again.error is not None and again.error.name == "NameError"
    assert sb.run_code("v").text == "'default'"


def test_a_context_survives_its_code_killing_the_kernel(
    code_image: str, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    sb = make_sandbox(image=code_image, kind="container")
    sb.run_code("w = 5")
    died = sb.run_code("import os\nos._exit(1)")
    assert died.error is not None and died.error.name == "KernelDied"
    after = sb.run_code("w")  # the kernel was restarted: the context answers, empty
    assert after.error is not None and after.error.name == "NameError"
    assert sb.run_code("w = 6\nw").text == "6"


def test_function_workers_run_code_in_a_kernel(code_image: str, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image=code_image, kind="function")
    assert sb.run_code("n = 20").engine == "jupyter"
    assert sb.run_code("n + 1").text == "21"


# the vm kind boots the image's own init: busybox's is the quickest to boot under emulation
PYTHON_WITH_INIT = ImageSpec("dsec/debian:12").apt("busybox").run("ln -sf /bin/busybox /sbin/init")


# The VM kinds run Debian 12's Python without ipykernel: the plain interpreter keeps state the same way.
@pytest.mark.parametrize("kind", ["container", "microvm", "vm"])
@pytest.mark.timeout(1200)
def test_without_a_kernel_a_plain_interpreter_keeps_state(
    kind: str, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    image = "dsec/debian:12"
    if kind == "vm":
        name = f"test/python-init:{secrets.token_hex(4)}"
        image = daemon.client().build(PYTHON_WITH_INIT, name).image.name  # its layers are cached after one build
    sb = make_sandbox(image=image, kind=kind)
    first = sb.run_code("import json\ndata = {'k': [1, 2]}")
    assert first.engine == "python" and first.error is None
    r = sb.run_code("print(json.dumps(data)); len(data['k'])")
    assert (r.stdout, r.text) == ('{"k": [1, 2]}\n', "2")
    err = sb.run_code("1 / 0")
    assert err.error is not None and err.error.name == "ZeroDivisionError"
    assert err.error.traceback[-1] == "ZeroDivisionError: division by zero"
    slow = sb.run_code("while True:\n    data['k'].append(0) if len(data['k']) < 3 else None", timeout=2)
    assert slow.error is not None and slow.error.name == "TimeoutError"
    assert sb.run_code("data['k']").text == "[1, 2, 0]"
    assert sb.run_code("v = 1", context="second").error is None
    assert sorted(sb.code_contexts()) == ["default", "second"]


def test_bad_requests_are_refused_clearly(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image="dsec/busybox", kind="container")
    with pytest.raises(dsec.errors.InvalidState, match="no python3"):
        sb.run_code("1")
    with pytest.raises(dsec.errors.InvalidRequest, match="context"):
        sb.run_code("1", context="../etc")
    with pytest.raises(dsec.errors.InvalidRequest, match="timeout"):
        sb.run_code("1", timeout=0)
    with pytest.raises(dsec.errors.InvalidRequest, match="language"):
        sb.run_code("1", language="cobol")


def test_a_sandbox_holds_a_bounded_number_of_contexts(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image="dsec/debian:12", kind="container")
    for i in range(MAX_CONTEXTS):
        assert sb.run_code(f"i = {i}", context=f"c{i}").error is None
    with pytest.raises(dsec.errors.QuotaExceeded, match=str(MAX_CONTEXTS)):
        sb.run_code("1", context="one-too-many")
    sb.remove_code_context("c0")
    assert sb.run_code("i", context="one-too-many").error is not None  # room again: a fresh context


@pytest.fixture
def python_sandbox(make_sandbox: Callable[..., dsec.Sandbox]) -> Iterator[dsec.Sandbox]:
    yield make_sandbox(image="dsec/debian:12", kind="container")


def test_the_context_lives_in_the_sandbox_not_in_the_caller(python_sandbox: dsec.Sandbox, daemon: Daemon) -> None:
    """Another client process (another trainer worker) reaches the same context by the sandbox's id."""
    python_sandbox.run_code("shared = 'set by the first client'")
    script = "import dsec, sys\nsb = dsec.Sandbox.connect(sys.argv[1])\nprint(sb.run_code('shared').text)\n"
    env = {"DSEC_URL": daemon.url, "DSEC_TOKEN": daemon.token, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [__import__("sys").executable, "-c", script, python_sandbox.id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "'set by the first client'"


@pytest.mark.timeout(900)
def test_a_context_outlives_a_daemon_killed_and_restarted(code_image: str) -> None:
    """The state is in the sandbox's kernel, not the daemon: a SIGKILLed daemon's successor reaches it."""
    state = Path(tempfile.mkdtemp(prefix="dsec-code-restart-"))
    d = start_daemon(state)
    try:
        sb = dsec.Sandbox.create(image=code_image, client=d.client())
        assert sb.run_code("answer = 6 * 7").engine == "jupyter"
        d.stop(signal.SIGKILL)
        d = start_daemon(state)
        again = dsec.Sandbox.connect(sb.id, client=d.client())
        assert again.run_code("answer").text == "42"
        again.kill()
    finally:
        d.stop()
        release_node(state)
    shutil.rmtree(state, ignore_errors=True)


def test_other_languages_are_compiled_and_run_once(code_image: str, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image=code_image, kind="container")
    sb.files.write("/tmp/main.cpp", b"a user's file of the same name as the source, left alone")
    hello = {
        "cpp": '#include <iostream>\nint main() { std::cout << "cpp " << 6 * 7 << "\\n"; }',
        "go": 'package main\nimport "fmt"\nfunc main() { fmt.Println("go", 6*7) }',
        "java": 'public class Main { public static void main(String[] a) { System.out.println("java " + 6 * 7); } }',
        "nodejs": "console.log('nodejs', 6 * 7)",
        "bash": "echo bash $((6 * 7))",
    }
    for language, code in hello.items():
        r = sb.run_code(code, language=language, timeout=120)
        assert (r.stdout, r.error, r.engine) == (f"{language} 42\n", None, "process"), (language, r)
    assert sb.files.read("/tmp/main.cpp").startswith(b"a user's file")
    broken = sb.run_code("int main() { return undefined_name; }", language="cpp", timeout=120)
    assert broken.error is not None and broken.error.name == "CompileError"
    assert any("undefined_name" in line for line in broken.error.traceback)
    failing = sb.run_code("echo out; exit 3", language="bash")
    assert (
        failing.stdout == "out\n"
        and failing.error is not None
        and failing.error.value == "the program ended with status 3"
    )
    slow = sb.run_code("sleep 30", language="bash", timeout=1)
    assert slow.error is not None and slow.error.name == "TimeoutError"
    with pytest.raises(dsec.errors.InvalidRequest, match="only python keeps a context"):
        sb.run_code("echo", language="bash", context="mine")
