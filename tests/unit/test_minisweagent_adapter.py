"""The mini-swe-agent adapter's pure parts, with no daemon: its config, and the way an exec's result
becomes mini-swe-agent's output dict and submission, held against mini-swe-agent's own LocalEnvironment
run on this host (tests/integration/test_minisweagent.py runs the adapter against a daemon)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import dsec

# read by mini-swe-agent when first imported: no banner, and no config directory in the user's home
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "dsec-tests-mswea"))

pytest.importorskip("minisweagent")
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted

from dsec.integrations.minisweagent import DsecEnvironment, DsecEnvironmentConfig, check_submitted, observation


def _local(command: str, timeout: int | None = None) -> Any:
    """LocalEnvironment's answer: its output dict, or the messages of the Submitted it raised."""
    try:
        return LocalEnvironment(cwd=tempfile.gettempdir()).execute({"command": command}, timeout=timeout)
    except Submitted as e:
        return e.messages


def _submitted(output: dict[str, Any]) -> Any:
    try:
        check_submitted(output)
    except Submitted as e:
        return e.messages
    return output


def test_the_config_defaults_and_what_it_refuses() -> None:
    c = DsecEnvironmentConfig()
    assert (c.image, c.kind, c.cwd, c.timeout, c.interpreter) == (
        "dsec/debian:12",
        "container",
        "/",
        30,
        ["bash", "-lc"],
    )
    assert c.url is None and c.token is None  # the SDK's DSEC_URL / DSEC_TOKEN, else the local daemon
    with pytest.raises(ValueError, match="container_timeout"):
        DsecEnvironmentConfig(container_timeout="2h")
    with pytest.raises(ValueError, match="pull"):
        DsecEnvironmentConfig(pull="never")


def test_the_token_stays_out_of_dumps_reprs_and_templates() -> None:
    c = DsecEnvironmentConfig(url="unix:///run/dsec.sock", token="s3cret-token")
    assert c.token is not None and c.token.get_secret_value() == "s3cret-token"
    for text in (repr(c), str(c.model_dump()), c.model_dump_json()):
        assert "s3cret" not in text
    assert c.model_dump()["url"] == "unix:///run/dsec.sock" and "token" not in c.model_dump()


def test_an_exit_status_and_its_output() -> None:
    res = dsec.ExecResult(exit_code=3, stdout="out\nerr\n")
    assert observation("x", 30, res) == {"output": "out\nerr\n", "returncode": 3, "exception_info": ""}
    # a result that names only the signal gets the shell's number for it, as docker exec reports it
    killed = dsec.ExecResult(exit_code=None, signal=9, stdout="partial")
    assert observation("x", 30, killed)["returncode"] == 137


def test_a_timeout_reads_exactly_as_the_local_environment_reports_it() -> None:
    command = "echo started; sleep 5; echo never"
    local = _local(command, timeout=1)
    res = dsec.ExecResult(exit_code=137, signal=9, stdout="started\n", timed_out=True)
    assert observation(command, 1, res) == local
    assert local["returncode"] == -1 and "timed out after 1 seconds" in local["exception_info"]


@pytest.mark.parametrize(
    ("command", "output", "code"),
    [
        (
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo diff line",
            "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff line\n",
            0,
        ),
        ("echo; echo '  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  '", "\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  \n", 0),
        ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 2", "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 2),
        ("echo a; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "a\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0),
        ("printf ''", "", 0),
    ],
    ids=["submits", "leading-blank-line", "nonzero-status", "not-first-line", "no-output"],
)
def test_the_submission_signal_is_the_local_environments(command: str, output: str, code: int) -> None:
    ours = _submitted(observation(command, 30, dsec.ExecResult(exit_code=code, stdout=output)))
    assert ours == _local(command)


def test_no_daemon_is_a_clear_error_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(dsec.DaemonUnreachable, match="is `dsec serve` running"):
        DsecEnvironment(url="unix:///nonexistent/dsec.sock", token="t")
    with pytest.raises(dsec.InvalidRequest, match="unsupported daemon URL"):
        DsecEnvironment(url="ftp://example.com", token="t")
    assert time.monotonic() - started < 30
