"""The unmodified ``e2b-code-interpreter`` package (PyPI, pinned in pyproject.toml) against a live daemon:
``Sandbox.run_code`` and its contexts, answered on port 49999 by dsec's code contexts (docs/e2b.md)."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from dsec.e2b.code_interpreter import IMAGE

from .conftest import Daemon

pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")
from e2b import NotFoundException, SandboxException, TimeoutException  # noqa: E402
from e2b_code_interpreter import OutputMessage, Sandbox  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str], daemon: Daemon) -> Iterator[Sandbox]:
    """The package's own template (code-interpreter-v1): dsec/e2b-code-interpreter:1, built first (from
    dsec/code:1, which takes minutes the first time) so the create is within the SDK's request timeout."""
    assert daemon.client().build_image(IMAGE).ready
    box = Sandbox.create(timeout=900)
    yield box
    box.kill()


def test_cells_keep_state_and_answer_as_jupyter_does(sbx: Sandbox) -> None:
    seen: list[str] = []
    first = sbx.run_code("x = 6 * 7\nprint('hello')\nx", on_stdout=lambda m: seen.append(m.line))
    assert (first.text, first.logs.stdout, seen, first.error) == ("42", ["hello\n"], ["hello\n"], None)
    second = sbx.run_code("import os, sys\nprint('err', file=sys.stderr)\n(x + 1, os.getcwd(), os.getuid())")
    # the kernel runs as root, as E2B's does, in the home of the image's account
    assert second.text == "(43, '/home/user', 0)" and second.logs.stderr == ["err\n"]
    assert second.execution_count == first.execution_count + 1
    failed = sbx.run_code("def f():\n    return 1 / 0\nf()")
    assert failed.error is not None and (failed.error.name, failed.error.value) == (
        "ZeroDivisionError",
        "division by zero",
    )
    assert "return 1 / 0" in failed.error.traceback and "\x1b[" not in failed.error.traceback


def test_output_arrives_while_the_cell_runs(sbx: Sandbox) -> None:
    started = time.monotonic()
    seen: list[tuple[str, str, float]] = []

    def at(kind: str) -> Callable[[OutputMessage], None]:
        return lambda m: seen.append((kind, m.line, time.monotonic() - started))

    code = "import sys, time\nprint('early')\ntime.sleep(3)\nprint('late', file=sys.stderr)\n'done'"
    done = sbx.run_code(code, on_stdout=at("out"), on_stderr=at("err"))
    ended = time.monotonic() - started
    assert [(k, line) for k, line, _ in seen] == [("out", "early\n"), ("err", "late\n")]
    assert seen[0][2] < ended - 2.5  # before the cell's end, not with it
    assert (done.text, done.logs.stdout, done.logs.stderr) == ("done", ["early\n"], ["late\n"])


def test_rich_results_displays_and_scoped_environment(sbx: Sandbox) -> None:
    shown = sbx.run_code(
        "import matplotlib.pyplot as plt, pandas as pd\nplt.plot([1, 2, 3])\nplt.show()\npd.DataFrame({'a': [1, 2]})"
    )
    figure, frame = shown.results
    assert not figure.is_main_result and base64.b64decode(figure.png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert frame.is_main_result and "<table" in frame.html
    assert frame.data == {"a": [1, 2]}  # the columns, as E2B's kernel gives a DataFrame
    scoped = sbx.run_code("import os\nos.environ.get('E2B_X')", envs={"E2B_X": "set"})
    assert scoped.text == "set"  # a string's value without its quotes, as E2B gives it
    assert sbx.run_code("os.environ.get('E2B_X')").text is None  # for that cell only


def test_a_package_pip_installed_by_a_command_is_importable_in_the_kernel(sbx: Sandbox) -> None:
    """E2B's pattern: ``commands.run("pip install ...")`` as the account, then ``run_code("import ...")``
    in the kernel that was already running (a local package: the test needs no index)."""
    setup = "from setuptools import setup\nsetup(name='dsecprobe', version='1', packages=['dsecprobe'])\n"
    sbx.files.write("probe/setup.py", setup)
    sbx.files.write("probe/dsecprobe/__init__.py", "VALUE = 7\n")
    assert sbx.run_code("1").error is None  # the kernel runs before the install
    sbx.commands.run("cd probe && pip install --no-deps --no-build-isolation --no-index .")
    assert sbx.run_code("import dsecprobe\ndsecprobe.VALUE").text == "7"


def test_contexts_are_separate_listed_restarted_and_removed(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("python", "/tmp")
    before = sbx.run_code("y = 1\nimport os\nos.getcwd()", context=ctx)
    assert before.text == "/tmp" and before.execution_count == 1  # the setup cell is not counted
    assert sbx.run_code("'y' in globals()").text == "False"  # the default context is another
    listed = sbx.list_code_contexts()  # the default one first (there before its first cell), the newest last
    assert (listed[0].id, listed[0].language, listed[-1].id, listed[-1].cwd) == ("default", "python", ctx.id, "/tmp")
    sbx.restart_code_context(ctx)
    after = sbx.run_code("import os\n('y' in globals(), os.getcwd())", context=ctx)
    assert after.text == "(False, '/tmp')"
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sbx.remove_code_context(ctx.id)
    in_root = sbx.create_code_context(cwd="/root")  # root's home: the kernel is root's
    assert sbx.run_code("import os\nos.getcwd()", context=in_root).text == "/root"
    sbx.remove_code_context(in_root)
    with pytest.raises(SandboxException, match=r"400.*the context cannot start in '/nonexistent'"):
        sbx.create_code_context(cwd="/nonexistent")


def test_a_cell_past_its_timeout_is_interrupted_and_the_context_goes_on(sbx: Sandbox) -> None:
    sbx.run_code("kept = 'still here'")
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=2)
    assert time.monotonic() - started < 30
    # the next cell does not wait behind the loop: it was interrupted when the client gave up
    started = time.monotonic()
    assert sbx.run_code("kept", timeout=60).text == "still here"
    assert time.monotonic() - started < 20
    # the same when the answer had begun (output streamed before the loop)
    with pytest.raises(TimeoutException):
        sbx.run_code("print('looping', flush=True)\nwhile True:\n    time.sleep(0.1)", timeout=2)
    started = time.monotonic()
    assert sbx.run_code("kept", timeout=60).text == "still here"
    assert time.monotonic() - started < 20


def test_other_languages_run_once_and_unknown_ones_are_refused(sbx: Sandbox) -> None:
    js = sbx.run_code("console.log(6 * 7)", language="javascript")
    assert js.logs.stdout == ["42\n"] and js.execution_count is None
    sh = sbx.run_code('echo "$GREETING"; exit 3', language="bash", envs={"GREETING": "hi"})
    assert sh.logs.stdout == ["hi\n"] and sh.error is not None and sh.error.name == "ExitError"
    assert sbx.run_code("pwd; id -un", language="bash").logs.stdout == ["/home/user\nroot\n"]
    with pytest.raises(SandboxException, match=r"400.*'typescript' is not one dsec runs"):
        sbx.run_code("let a: number = 1", language="typescript")
    with pytest.raises(SandboxException, match=r"400.*only python keeps a context"):
        sbx.create_code_context(language="javascript")


def test_port_49999_needs_the_traffic_token_and_the_routes_a_sandbox(sbx: Sandbox, e2b_env: dict[str, str]) -> None:
    url = e2b_env["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    denied = httpx.get(f"{url}/contexts", headers={**headers, "E2B-Traffic-Access-Token": "wrong"})
    assert denied.status_code == 403 and "traffic access token" in denied.text
    # a sandbox's token opens its own port only
    token = {"E2B-Traffic-Access-Token": str(sbx.traffic_access_token)}
    other = httpx.get(f"{url}/contexts", headers={**headers, "E2b-Sandbox-Id": "sb-000000000000", **token})
    assert other.status_code == 403
    assert httpx.get(f"{url}/contexts", headers={**headers, **token}).status_code == 200
    # dsec's routes behind the port name no sandbox of their own: called directly they are not found
    direct = httpx.post(f"{url}/code-interpreter/execute", json={"code": "1"}, headers={"X-API-Key": "x"})
    assert direct.status_code == 404


def test_the_plain_interpreter_answers_where_the_image_has_no_kernel(e2b_env: dict[str, str]) -> None:
    """dsec/e2b-base:1 has python3 but no Jupyter: dsec's own interpreter keeps the state."""
    with Sandbox.create("dsec/e2b-base:1", timeout=300) as box:
        lines: list[str] = []
        assert box.run_code("z = 5\nprint('a', 'b')\nz * 2", on_stdout=lambda m: lines.append(m.line)).text == "10"
        assert lines == ["a b\n"]  # print's pieces sent as one line, as Jupyter does
        later = box.run_code("import os\n(z, os.environ.get('Q'))", envs={"Q": "1"})
        assert later.text == "(5, '1')" and later.execution_count == 2
        assert box.run_code("os.environ.get('Q')").text is None
        started = time.monotonic()
        with pytest.raises(TimeoutException):
            box.run_code("while True:\n    pass", timeout=2)
        assert box.run_code("z", timeout=60).text == "5" and time.monotonic() - started < 30
        ctx = box.create_code_context(cwd="/tmp")
        first = box.run_code("import os\nos.getcwd()", context=ctx)
        assert (first.text, first.execution_count) == ("/tmp", 1)  # the setup cell is not counted here either


@pytest.mark.parametrize("first", ["", "print('started', flush=True)\n"])
def test_a_sandbox_killed_mid_cell_drops_the_answer_as_e2b_does(e2b_env: dict[str, str], first: str) -> None:
    """The connection drops (before or after output began), so the package finds the sandbox gone and
    says so, rather than a 404 of the sandbox's agent."""
    box = Sandbox.create("dsec/e2b-base:1", timeout=300)
    killer = threading.Timer(2.0, box.kill)
    killer.start()
    try:
        with pytest.raises(TimeoutException, match="killed while the request was in progress"):
            box.run_code(first + "import time\ntime.sleep(120)", timeout=60)
    finally:
        killer.cancel()
        box.kill()
