from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dsec.protocol.names import MAX_REFERENCE
from dsec.protocol.sandbox import MAX_EXEC_TIMEOUT_S, MAX_TTL_S, CreateSandbox, ExecRequest, ExecResult, Limits

# ---- Limits ------------------------------------------------------------------------------------------


def test_limits_defaults() -> None:
    lim = Limits()
    assert lim.cpu == 0.25  # a request: idle agent sandboxes use a few percent of it
    assert lim.cpu_limit is None
    assert lim.memory == 512 << 20
    assert lim.memory_request is None and lim.mem_request() == 128 << 20  # a quarter of the limit
    assert lim.disk == 1 << 30
    assert lim.pids == 1024


def test_memory_request_within_the_limit() -> None:
    assert Limits(memory="1Gi", memory_request="1Gi").mem_request() == 1 << 30
    assert Limits(memory="1Gi", memory_request="16Mi").mem_request() == 16 << 20
    with pytest.raises(ValueError, match=r"memory_request .* exceeds the memory limit"):
        Limits(memory="256Mi", memory_request="512Mi")


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("512Mi", 512 << 20), ("1Gi", 1 << 30), ("8Mi", 8 << 20), (64 << 20, 64 << 20), ("1Ti", 1 << 40)],
)
def test_limits_memory_accepts_sizes(memory: Any, expected: int) -> None:
    assert Limits(memory=memory).memory == expected


def test_limits_disk_accepts_sizes() -> None:
    assert Limits(disk="2Gi").disk == 2 << 30


@pytest.mark.parametrize(
    ("memory", "needle"),
    [
        ("7Mi", "at least 8Mi"),
        ((8 << 20) - 1, "at least 8Mi"),
        (0, "at least 8Mi"),
        ("2Ti", "at most 1Ti"),
        (-1, "negative"),
        ("-1Gi", "cannot parse"),
        ("lots", "cannot parse"),
        ("5Xi", "unknown size unit"),
        (True, "memory"),
        ([1], "memory"),
    ],
)
def test_limits_memory_rejects(memory: Any, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        Limits(memory=memory)
    assert needle in str(info.value)


@pytest.mark.parametrize("disk", ["512Ki", "17Ti", -5])
def test_limits_disk_rejects(disk: Any) -> None:
    with pytest.raises(ValidationError):
        Limits(disk=disk)


@pytest.mark.parametrize(
    "fields",
    [
        {"cpu": 0},
        {"cpu": -1},
        {"cpu": 257},
        {"cpu": float("nan")},
        {"cpu": float("inf")},
        {"cpu_limit": 0},
        {"cpu_limit": 1000},
        {"pids": 7},
        {"pids": (1 << 20) + 1},
        {"gpus": 1},
    ],
)
def test_limits_rejects(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Limits(**fields)


def test_limits_extra_field_is_forbidden() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Limits.model_validate({"cpu": 1, "swap": "1Gi"})


# ---- CreateSandbox ------------------------------------------------------------------------------------


def test_create_defaults() -> None:
    req = CreateSandbox()
    assert req.image == "dsec/debian:12"
    assert req.kind == "container"
    assert req.timeout == 600.0
    assert req.env == {}
    assert req.labels == {}
    assert req.limits == Limits()


def test_create_parses_nested_limits() -> None:
    req = CreateSandbox.model_validate({"limits": {"memory": "512Mi", "cpu": 2, "cpu_limit": 1.5}})
    assert req.limits.memory == 512 << 20
    assert req.limits.cpu == 2
    assert req.limits.cpu_limit == 1.5


@pytest.mark.parametrize(
    "body",
    [
        {"extra": 1},
        {"limits": {"memory": "512Mi", "bogus": 1}},
        {"image": ""},
        {"image": "x" * (MAX_REFERENCE + 1)},
        {"image": "Upper/case"},
        {"kind": "banana"},
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": MAX_TTL_S + 1},
        {"timeout": 1e12},
        {"timeout": float("inf")},
        {"timeout": float("nan")},
        {"limits": {"memory": "1Mi"}},
        {"env": {"A=B": "x"}},
        {"env": {"": "x"}},
        {"env": {"A\0": "x"}},
        {"env": {"A": "x\0y"}},
        {"labels": {"": "x"}},
        {"labels": {"k" * 129: "x"}},
        {"labels": {"k": "v" * 513}},
        {"labels": {f"k{i}": "v" for i in range(65)}},
    ],
)
def test_create_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CreateSandbox.model_validate(body)


def test_create_accepts_the_edges() -> None:
    req = CreateSandbox.model_validate(
        {
            "timeout": MAX_TTL_S,
            "labels": {f"k{i}": "v" * 512 for i in range(64)},
            "env": {"A": "a=b", "EMPTY": ""},
        }
    )
    assert req.timeout == MAX_TTL_S
    assert len(req.labels) == 64
    assert req.env["A"] == "a=b"


@pytest.mark.parametrize("kind", ["container", "function", "microvm", "vm"])
def test_create_known_kinds_validate(kind: str) -> None:
    # whether a kind is *available* is the core's business; the model knows the names
    assert CreateSandbox(kind=kind).kind == kind  # type: ignore[arg-type]


def test_create_env_error_names_the_variable() -> None:
    with pytest.raises(ValidationError) as info:
        CreateSandbox(env={"BAD=NAME": "1"})
    assert "BAD=NAME" in str(info.value)


# ---- ExecRequest --------------------------------------------------------------------------------------


def test_exec_defaults() -> None:
    req = ExecRequest(cmd="true")
    assert req.timeout == 60.0
    assert req.cwd is None
    assert req.env == {}
    assert req.stdin is None
    assert req.output_limit == 1 << 20


def test_exec_argv_of_a_string_runs_the_shell() -> None:
    assert ExecRequest(cmd="echo hi | wc -c").argv() == ["/bin/sh", "-c", "echo hi | wc -c"]


def test_exec_argv_of_a_list_is_the_list() -> None:
    req = ExecRequest(cmd=["python3", "-c", "print(1)"])
    argv = req.argv()
    assert argv == ["python3", "-c", "print(1)"]
    argv.append("mutated")
    assert req.argv() == ["python3", "-c", "print(1)"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"cmd": ""}, "cmd is empty"),
        ({"cmd": "   \n"}, "cmd is empty"),
        ({"cmd": []}, "argv is empty"),
        ({"cmd": ["", "x"]}, "argv is empty"),
        ({"cmd": "echo \0"}, "NUL"),
        ({"cmd": ["echo", "a\0b"]}, "NUL"),
        ({"cmd": "true", "cwd": "relative/dir"}, "absolute"),
        ({"cmd": "true", "cwd": "."}, "absolute"),
        ({"cmd": "true", "cwd": "/tmp\0x"}, "absolute"),
        ({"cmd": "true", "timeout": 0}, "timeout"),
        ({"cmd": "true", "timeout": -5}, "timeout"),
        ({"cmd": "true", "timeout": MAX_EXEC_TIMEOUT_S + 1}, "timeout"),
        ({"cmd": "true", "timeout": float("inf")}, "timeout"),
        ({"cmd": "true", "timeout": float("nan")}, "timeout"),
        ({"cmd": "true", "env": {"A=B": "1"}}, "A=B"),
        ({"cmd": "true", "env": {"": "1"}}, "env"),
        ({"cmd": "true", "output_limit": 1023}, "output_limit"),
        ({"cmd": "true", "output_limit": (64 << 20) + 1}, "output_limit"),
        ({"cmd": "true", "shell": True}, "Extra inputs"),
        ({}, "cmd"),
        ({"cmd": 5}, "cmd"),
    ],
)
def test_exec_rejects(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        ExecRequest.model_validate(body)
    assert needle in str(info.value)


def test_exec_accepts_absolute_cwd_and_env() -> None:
    req = ExecRequest(cmd="pwd", cwd="/work/x", env={"A": "1"}, stdin="input", timeout=MAX_EXEC_TIMEOUT_S)
    assert req.cwd == "/work/x"
    assert req.env == {"A": "1"}


def test_exec_result_ok() -> None:
    assert ExecResult(exit_code=0).ok
    assert not ExecResult(exit_code=1).ok
    assert not ExecResult(exit_code=None, signal=9).ok
