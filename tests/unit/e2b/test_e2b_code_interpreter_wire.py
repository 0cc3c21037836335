"""How dsec's code results become the JSON lines the e2b-code-interpreter package parses, read back with
the package's own parser (``e2b_code_interpreter.models.parse_output``)."""

from __future__ import annotations

import json

import pytest

from dsec.e2b.code_interpreter_port import JUPYTER_PORT
from dsec.e2b.code_interpreter_wire import ExecuteBody, check_env, execution_lines, language, result_line
from dsec.errors import InvalidRequest
from dsec.protocol.code import CodeError, CodeResult

models = pytest.importorskip("e2b_code_interpreter.models")
constants = pytest.importorskip("e2b_code_interpreter.constants")


def parsed(raw: bytes) -> models.Execution:
    execution = models.Execution()
    for line in raw.decode().splitlines():
        models.parse_output(execution, line)
    return execution


def test_the_port_and_template_are_the_packages() -> None:
    from dsec.e2b.code_interpreter import TEMPLATE

    assert (JUPYTER_PORT, TEMPLATE) == (constants.JUPYTER_PORT, constants.DEFAULT_TEMPLATE)


def test_a_cell_reads_back_as_the_package_sees_it() -> None:
    res = CodeResult(
        stdout="hi\n",
        stderr="warn\n",
        result={"text/plain": "42", "text/html": "<b>42</b>", "application/json": '{"a": 1}'},
        outputs=[{"image/png": "iVBOR", "text/plain": "<Figure>", "application/x-custom": "z"}],
        execution_count=3,
        context="default",
        engine="jupyter",
    )
    execution = parsed(execution_lines(res, stateful=True))
    assert execution.logs.stdout == ["hi\n"] and execution.logs.stderr == ["warn\n"]
    assert execution.text == "42" and execution.execution_count == 3 and execution.error is None
    figure, main = execution.results
    assert (figure.png, figure.text, figure.is_main_result, figure.extra) == (
        "iVBOR",
        "<Figure>",
        False,
        {"application/x-custom": "z"},
    )
    assert (main.html, main.json, main.is_main_result) == ("<b>42</b>", {"a": 1}, True)


def test_an_error_carries_its_traceback_as_one_text_and_a_run_once_has_no_count() -> None:
    error = CodeError(name="ExitError", value="the program ended with status 2", traceback=["a", "b"])
    res = CodeResult(stdout="", error=error, context="", engine="process", truncated=True)
    raw = execution_lines(res, stateful=False)
    execution = parsed(raw)
    assert execution.error is not None
    assert (execution.error.name, execution.error.traceback) == ("ExitError", "a\nb")
    assert execution.execution_count is None
    assert "dropped" in execution.logs.stderr[0]  # truncation is said, not silent
    assert json.loads(raw.splitlines()[-1]) == {"type": "end_of_execution"}
    streamed = parsed(execution_lines(res.model_copy(update={"stdout": "x"}), stateful=False, streamed=True))
    assert streamed.logs.stdout == [] and streamed.error is not None  # sent as written: not again at the end


def test_languages_map_to_dsecs_and_others_are_refused_by_name() -> None:
    assert [language(n) for n in (None, "python", "JavaScript", "bash", "java")] == [
        "python",
        "python",
        "nodejs",
        "bash",
        "java",
    ]
    with pytest.raises(InvalidRequest, match="'typescript' is not one dsec runs"):
        language("typescript")
    with pytest.raises(InvalidRequest, match="'r'"):
        language("r")


def test_bodies_and_environment_are_checked() -> None:
    body = ExecuteBody.model_validate({"code": "1", "context_id": None, "language": None, "env_vars": None, "x": 1})
    assert body.code == "1"
    assert check_env({"A": "1"}) == {"A": "1"} and check_env({}) is None and check_env(None) is None
    for bad in ({"": "1"}, {"A=B": "1"}, {"A": "\0"}):
        with pytest.raises(InvalidRequest):
            check_env(bad)


def test_a_strings_value_is_given_without_its_quotes_as_e2b_does() -> None:
    assert [result_line({"text/plain": t}, main=True)["text"] for t in ("'a'", '"b"', "'", "'c\"", "d")] == [
        "a",
        "b",
        "'",
        "'c\"",
        "d",
    ]


def test_a_json_value_that_is_not_json_stays_text() -> None:
    assert result_line({"application/json": "not json"}, main=True)["json"] == "not json"
