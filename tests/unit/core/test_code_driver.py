"""run_code's in-sandbox driver, run here as it runs in a sandbox (``python3 -c BOOT SOURCE call CONTEXT``) on
this host's Python, which has no ipykernel: the plain interpreter's behaviour, and the runner's mapping of the
driver's answers and exit statuses to results and errors."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.core.code.runner import BOOT, DRIVER, CodeRunner, LiveLines
from dsec.errors import BackendError, InvalidState, QuotaExceeded
from dsec.protocol.code import CodeRequest
from dsec.protocol.sandbox import ExecRequest, ExecResult
from dsec.tenancy import OPERATOR

pytestmark = pytest.mark.timeout(60)


def call(context: str, request: dict[str, Any], most: int = 16) -> tuple[int, dict[str, Any], str]:
    p = subprocess.run(
        [sys.executable, "-c", BOOT, DRIVER, "call", context, str(most)],
        input=json.dumps(request).encode(),
        capture_output=True,
        timeout=30,
    )
    out = json.loads(p.stdout) if p.returncode == 0 else {}
    return p.returncode, out, p.stderr.decode()


def run(context: str, code: str, timeout: float = 5.0) -> dict[str, Any]:
    status, out, err = call(context, {"op": "run", "code": code, "timeout": timeout})
    assert status == 0, err
    return out


@pytest.fixture
def context() -> Iterator[str]:
    name = f"unit-{secrets.token_hex(4)}"
    yield name
    call(name, {"op": "stop"})


def test_state_survives_and_the_last_expression_is_the_result(context: str) -> None:
    assert run(context, "x = 6 * 7")["result"] is None
    out = run(context, "import sys\nprint('o'); print('e', file=sys.stderr)\nx")
    assert (out["stdout"], out["stderr"], out["result"], out["engine"]) == (
        "o\n",
        "e\n",
        {"text/plain": "42"},
        "python",
    )
    assert out["execution_count"] == 2
    assert run(context, "_")["result"] == {"text/plain": "42"}  # the last result, as in a REPL


def test_errors_are_structured_and_keep_the_context(context: str) -> None:
    run(context, "kept = 1")
    err = run(context, "def f():\n    raise ValueError('bad value')\nf()")["error"]
    assert err["name"] == "ValueError" and err["value"] == "bad value"
    assert err["traceback"][0] == "Traceback (most recent call last):"
    assert any("line 2, in f" in line for line in err["traceback"])
    assert not any("driver" in line or "exec(" in line for line in err["traceback"])  # the cell's frames only
    syntax = run(context, "def (")["error"]
    assert syntax["name"] == "SyntaxError"
    exiting = run(context, "raise SystemExit(3)")["error"]  # the context outlives the code's exit
    assert exiting["name"] == "SystemExit"
    assert run(context, "kept")["result"] == {"text/plain": "1"}


def test_a_timeout_interrupts_and_keeps_the_state(context: str) -> None:
    run(context, "n = 0")
    out = run(context, "while True:\n    n += 1", timeout=0.5)
    assert out["error"]["name"] == "TimeoutError" and "kept" in out["error"]["value"]
    assert int(run(context, "n")["result"]["text/plain"]) > 0
    # code that swallows exceptions cannot keep the interrupt from ending the cell
    swallowed = run(context, "while True:\n    try:\n        n += 1\n    except Exception:\n        pass", timeout=0.5)
    assert swallowed["error"]["name"] == "TimeoutError"


def test_rich_representations_of_the_result(context: str) -> None:
    code = (
        "class T:\n"
        "    def _repr_html_(self):\n        return '<b>t</b>'\n"
        "    def __repr__(self):\n        return 'T()'\n"
        "T()"
    )
    assert run(context, code)["result"] == {"text/plain": "T()", "text/html": "<b>t</b>"}


def test_output_is_bounded(context: str) -> None:
    out = run(context, "print('x' * (3 << 20))")
    assert out["truncated"] and len(out["stdout"]) == 1 << 20


def test_contexts_are_separate_and_bounded(context: str) -> None:
    other = f"{context}-b"
    try:
        run(context, "v = 'a'")
        run(other, "v = 'b'")
        assert run(context, "v")["result"] == {"text/plain": "'a'"}
        live = subprocess.run(
            [sys.executable, "-c", BOOT, DRIVER, "list", context], capture_output=True, timeout=30, check=True
        )
        assert {context, other} <= set(json.loads(live.stdout))
        status, _, err = call(f"{context}-c", {"op": "run", "code": "1", "timeout": 5}, most=1)
        assert status == 4 and "code contexts already" in err
    finally:
        call(other, {"op": "stop"})
    assert call(other, {"op": "stop"})[1] == {"stopped": False}


def test_a_cells_environment_is_its_own_and_a_quiet_cell_is_not_counted(context: str) -> None:
    run(context, "import os")
    status, out, err = call(
        context, {"op": "run", "code": "os.environ['DSEC_T']", "timeout": 5, "env": {"DSEC_T": "1"}}
    )
    assert status == 0 and out["result"] == {"text/plain": "'1'"}, err
    before = run(context, "os.environ.get('DSEC_T')")
    assert before["result"] is None  # put back after the cell
    status, quiet, _ = call(context, {"op": "run", "code": "q = 1", "timeout": 5, "quiet": True})
    assert status == 0 and quiet["execution_count"] == before["execution_count"]
    assert run(context, "q")["execution_count"] == before["execution_count"] + 1


def test_a_live_request_gets_its_output_lines_before_the_answer(context: str) -> None:
    request = {"op": "run", "code": "print('a', 'b')\nprint('c', end='')\n1", "timeout": 5, "live": True}
    p = subprocess.run(
        [sys.executable, "-c", BOOT, DRIVER, "call", context, "16"],
        input=json.dumps(request).encode(),
        capture_output=True,
        timeout=30,
    )
    *frames, answer = [json.loads(line) for line in p.stdout.splitlines()]
    assert frames == [{"stream": "stdout", "text": "a b\n"}, {"stream": "stdout", "text": "c"}]
    assert answer["stdout"] == "a b\nc" and answer["result"] == {"text/plain": "1"}


def test_an_interrupt_stops_the_running_cell_and_keeps_the_state(context: str, tmp_path: Path) -> None:
    started = tmp_path / "started"
    run(context, "n = 0")
    argv = [sys.executable, "-c", BOOT, DRIVER, "call", context, "16"]
    cell = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert cell.stdin is not None and cell.stdout is not None
    code = f"open({str(started)!r}, 'w').close()\nwhile True:\n    n += 1"
    cell.stdin.write(json.dumps({"op": "run", "code": code, "timeout": 30}).encode())
    cell.stdin.close()
    for _ in range(200):  # an interrupt is for a running cell: one that comes before it is not kept
        if started.exists():
            break
        time.sleep(0.05)
    sent = subprocess.run([sys.executable, "-c", BOOT, DRIVER, "interrupt", context], capture_output=True)
    assert json.loads(sent.stdout) == {"interrupted": True}
    assert cell.wait(timeout=20) == 0
    assert json.loads(cell.stdout.read())["error"]["name"] == "KeyboardInterrupt"
    assert int(run(context, "n")["result"]["text/plain"]) > 0
    gone = subprocess.run([sys.executable, "-c", BOOT, DRIVER, "interrupt", "unit-no-such"], capture_output=True)
    assert json.loads(gone.stdout) == {"interrupted": False}


def test_live_lines_pass_on_whole_output_lines_only() -> None:
    got: list[tuple[str, str]] = []
    lines = LiveLines(lambda stream, text: got.append((stream, text)))
    frame = json.dumps({"stream": "stdout", "text": "hi\n"}).encode() + b"\n"
    lines.take("stdout", frame[:5])
    lines.take("stderr", b"ignored\n")
    lines.take("stdout", frame[5:] + b'{"stdout": "an answer", "result": null}')
    lines.take("stdout", b"\nnot json\n")
    assert got == [("stdout", "hi\n")]


class Exec:
    """The one call the runner makes, answered as a sandbox would."""

    def __init__(self, result: ExecResult) -> None:
        self.result = result
        self.requests: list[ExecRequest] = []

    async def call(self, sandbox_id: str, name: str, req: ExecRequest, **_: Any) -> tuple[ExecResult, bool]:
        assert name == "exec"
        self.requests.append(req)
        return self.result, False


async def run_with(result: ExecResult) -> Any:
    runner = CodeRunner(Exec(result), None, None)  # type: ignore[arg-type]
    return await runner.run("sb", CodeRequest(code="1", timeout=5), caller=OPERATOR)


async def test_the_runner_maps_the_drivers_failures_to_errors() -> None:
    with pytest.raises(InvalidState, match="no python3"):
        await run_with(ExecResult(exit_code=127, stderr="python3: not found"))
    with pytest.raises(QuotaExceeded, match="16 code contexts"):
        await run_with(ExecResult(exit_code=4))
    with pytest.raises(BackendError, match="could not start"):
        await run_with(ExecResult(exit_code=3, stderr="ModuleNotFoundError: zmq"))
    with pytest.raises(BackendError, match="ended while running"):
        await run_with(ExecResult(exit_code=0, stdout=""))


async def test_the_runner_gives_the_code_time_to_start_a_kernel() -> None:
    answer = {"stdout": "", "stderr": "", "result": {"text/plain": "1"}, "outputs": [], "error": None}
    answer |= {"execution_count": 1, "engine": "jupyter", "truncated": False}
    fake = Exec(ExecResult(exit_code=0, stdout=json.dumps(answer)))
    result = await CodeRunner(fake, None, None).run("sb", CodeRequest(code="1", timeout=5), caller=OPERATOR)  # type: ignore[arg-type]
    assert result.text == "1" and result.context == "default"
    req = fake.requests[0]
    assert req.timeout > 5 + 180 and json.loads(req.stdin or "") == {"op": "run", "code": "1", "timeout": 5.0}
