"""The SandboxFusion models and the mapping of a compile-then-run onto SandboxFusion's answer: what the
real sandbox-fusion 0.3.7 client sends parses, what dsec answers parses in the client, and each way a
step can end maps to the status SandboxFusion gives it."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import sandbox_fusion as sf
from pydantic import ValidationError

from dsec.errors import ImageNotFound, InvalidRequest, QuotaExceeded, SandboxTimeout
from dsec.fusion.errors import answer_for
from dsec.fusion.models import RunCodeRequest, RunCodeResponse
from dsec.fusion.service import FusionOptions, answer, command_result
from dsec.protocol.languages import CompileRunResult, StepResult


def step(status: str = "finished", **kw: Any) -> StepResult:
    return StepResult(**{"exit_code": 0, "stdout": "", "stderr": "", "duration": 0.25, **kw}, status=status)


def test_what_the_client_sends_parses_and_unknown_fields_are_ignored() -> None:
    sent = sf.RunCodeRequest(
        code="print(1)", language="python", stdin="x", files={"a/b.txt": base64.b64encode(b"hi").decode(), "n": None}
    ).dict()
    req = RunCodeRequest.model_validate(sent | {"memory_limit_MB": 1024, "some_future_field": [1, 2]})
    assert req.compile_timeout == 10 and req.run_timeout == 10 and req.fetch_files == []
    assert req.file_bytes() == {"/tmp/a/b.txt": b"hi"}  # relative: under the run's directory; null: skipped
    assert req.memory() == 1024 << 20
    assert not hasattr(req, "some_future_field")


@pytest.mark.parametrize("value, memory", [(None, None), (-1, None), (0, None), (8, 8 << 20), (2048, 2048 << 20)])
def test_memory_limit_mb(value: int | None, memory: int | None) -> None:
    assert RunCodeRequest(code="", language="python", memory_limit_MB=value).memory() == memory


@pytest.mark.parametrize(
    "fields",
    [
        {"memory_limit_MB": 7},
        {"memory_limit_MB": 1 << 30},
        {"compile_timeout": 0},
        {"run_timeout": 3601},
        {"language": ""},
        {"files": {"x": "%%%"}},
        {"files": {"a/../../x": "eA=="}},
        {"files": {"": "eA=="}},
        {"fetch_files": ["../x"]},
        {"fetch_files": ["a\0b"]},
        {"files": {f"f{i}": None for i in range(257)}},
    ],
)
def test_bad_fields_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RunCodeRequest.model_validate({"code": "", "language": "python"} | fields)


def test_what_dsec_answers_parses_in_the_client() -> None:
    result = CompileRunResult(language="cpp", compile=step(), run=step(stdout="hi\n"))
    ours = answer(result, {"out.txt": "aGk="}, [], "sb-1", "dsec/code:1")
    theirs = sf.RunCodeResponse(**ours.model_dump(mode="json"))
    assert theirs.status == sf.RunStatus.Success and theirs.executor_pod_name == "sb-1"
    assert theirs.compile_result is not None and theirs.compile_result.status == sf.CommandRunStatus.Finished
    assert theirs.run_result is not None and theirs.run_result.stdout == "hi\n" and theirs.files == {"out.txt": "aGk="}
    assert sf.summary_run_code_result(theirs, sf.SummaryMapping()) == "Success"


def test_each_ending_maps_to_sandbox_fusions_status() -> None:
    compile_error = answer(CompileRunResult(language="c", compile=step(exit_code=1)), {}, [], "sb", "img")
    assert compile_error.status == "Failed" and compile_error.run_result is None
    assert compile_error.compile_result is not None and compile_error.compile_result.return_code == 1

    timeout = command_result(step("timeout", exit_code=137, signal=9, stdout="so far"))
    assert timeout.status == "TimeLimitExceeded" and timeout.return_code is None and timeout.stdout == "so far"
    assert answer(CompileRunResult(language="python", run=step("timeout")), {}, [], "sb", "img").status == "Failed"

    killed = command_result(step(exit_code=137, signal=9))  # dsec reports 128+N and the signal
    assert killed.status == "Finished" and killed.return_code == -9

    failed = answer(CompileRunResult(language="python", run=step(exit_code=3)), {}, [], "sb", "img")
    assert failed.status == "Failed" and failed.run_result is not None and failed.run_result.return_code == 3

    missing = step("error", exit_code=127, stderr="dsec: cannot run g++: No such file or directory\n")
    error = answer(CompileRunResult(language="cpp", compile=missing), {}, [], "sb", "dsec/debian:12")
    assert error.status == "SandboxError" and error.compile_result is not None
    assert error.compile_result.status == "Error"
    assert "cannot run g++" in error.message and "dsec/debian:12" in error.message


def test_files_left_out_are_named_in_the_message() -> None:
    res = answer(CompileRunResult(language="python", run=step()), {}, ["big.bin"], "sb", "img")
    assert res.status == "Success" and "big.bin" in res.message


def test_a_sandbox_error_answer_is_what_the_client_raises_on() -> None:
    theirs = sf.RunCodeResponse(**RunCodeResponse.sandbox_error("why").model_dump(mode="json"))
    assert theirs.status == sf.RunStatus.SandboxError and theirs.message == "why"


@pytest.mark.parametrize("listen", ["unix:///x.sock", "http://127.0.0.1", "http://:80", "http://h:1/run_code"])
def test_the_listen_flag_is_checked(listen: str) -> None:
    with pytest.raises(InvalidRequest, match="--sandbox-fusion-listen"):
        FusionOptions.of(listen, "dsec/code:1")
    assert FusionOptions.of("http://127.0.0.1:8080", "img").image == "img"


def test_errors_become_sandbox_fusion_answers() -> None:
    full = answer_for(QuotaExceeded("the function pool is at its maximum"))
    assert full.status_code == 504  # the one status verl retries on
    assert json.loads(full.body)["detail"].startswith("quota_exceeded: ")
    assert answer_for(SandboxTimeout("waited too long")).status_code == 504
    gone = answer_for(ImageNotFound("no image dsec/code:1"))
    assert gone.status_code == 200 and json.loads(gone.body) | {"message": ""} == {
        **RunCodeResponse.sandbox_error("").model_dump(mode="json")
    }
    assert json.loads(gone.body)["message"] == "image_not_found: no image dsec/code:1"
    bug = answer_for(RuntimeError("oops"))
    assert bug.status_code == 200 and json.loads(bug.body)["message"] == "internal error: RuntimeError: oops"
