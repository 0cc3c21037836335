"""What Harbor's task settings become in dsec (dsec.integrations.harbor.mapping and options), on the suite's
Python, where Harbor itself (3.12 and newer) is not installed: the image name a Dockerfile is built under,
limits, network policies, accounts' homes and command results. The whole path runs in
tests/integration/test_harbor.py."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

import dsec
from dsec.integrations.harbor.mapping import (
    MAX_EXEC,
    TIMED_OUT,
    CommandResult,
    command_result,
    home_of,
    image_name,
    limits,
    network_spec,
)
from dsec.integrations.harbor.options import DsecOptions
from dsec.protocol.names import check_name
from dsec.protocol.network import NetworkAllow
from dsec.protocol.sandbox import Limits


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ("hello-world", "harbor/hello-world:abc123"),
        ("Fix_The.Bug", "harbor/fix_the.bug:abc123"),
        ("org/task name!", "harbor/org-task-name:abc123"),
        ("--.__", "harbor/task:abc123"),
        ("x" * 300, f"harbor/{'x' * 100}:abc123"),
    ],
)
def test_a_task_name_becomes_an_image_name_dsec_accepts(task: str, expected: str) -> None:
    name = image_name(task, "abc123")
    assert name == expected
    assert check_name(name) == name


def test_the_tag_is_the_environments_content_hash() -> None:
    assert image_name("t", "0123456789abcdef" * 4) == "harbor/t:" + "0123456789abcdef" * 2
    assert image_name("t", "") == "harbor/t:latest"


def test_network_modes_become_dsec_policies_the_daemon_accepts() -> None:
    assert network_spec("no-network", []) is None
    assert network_spec("public", []) == "full"
    allow = network_spec("allowlist", ["pypi.org", "10.1.2.3", "10.9.8.0/24"])
    assert allow == {"allow": ["pypi.org:*", "10.1.2.3:*", "10.9.8.0/24:*"]}
    assert NetworkAllow.model_validate(allow).allow == allow["allow"]  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown Harbor network mode 'bridged'"):
        network_spec("bridged", [])


def test_resources_become_sandbox_limits() -> None:
    ceilings = limits(cpu_request=None, cpu_limit=2, memory_request_mb=None, memory_limit_mb=4096, storage_mb=10240)
    assert ceilings == {"cpu_limit": 2.0, "memory": "4096Mi", "disk": "10240Mi"}
    both = limits(cpu_request=0.5, cpu_limit=0.5, memory_request_mb=512, memory_limit_mb=2048, storage_mb=None)
    assert both == {"cpu": 0.5, "cpu_limit": 0.5, "memory": "2048Mi", "memory_request": "512Mi"}
    # a request alone: dsec always caps memory, at no less than what was asked for
    asked = limits(cpu_request=4, cpu_limit=None, memory_request_mb=8192, memory_limit_mb=None, storage_mb=None)
    assert asked == {"cpu": 4.0, "memory": "8192Mi", "memory_request": "8192Mi"}
    assert limits(cpu_request=None, cpu_limit=None, memory_request_mb=None, memory_limit_mb=None, storage_mb=None) == {}
    for made in (ceilings, both, asked):
        Limits.model_validate(made)  # the daemon's own model takes them


PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n# a comment\nagent:x:1000:1000::/home/agent:/bin/sh\nnohome:x:7:7:::/bin/sh\n"
)


@pytest.mark.parametrize(
    ("user", "home"),
    [
        ("agent", "/home/agent"),
        ("1000", "/home/agent"),
        ("agent:staff", "/home/agent"),
        ("1000:1000", "/home/agent"),
        ("root", "/root"),
        ("0", "/root"),
        ("nohome", "/"),
        ("ghost", None),
        ("4242", None),
    ],
)
def test_an_accounts_home_comes_from_the_sandboxs_passwd(user: str, home: str | None) -> None:
    assert home_of(user, PASSWD) == home


def test_root_has_a_home_even_without_a_passwd_file() -> None:
    assert home_of("root", "") == "/root" and home_of("agent", "") is None


def result(**kw: object) -> dsec.ExecResult:
    return dsec.ExecResult.model_validate({"stdout": "out", "stderr": "", **kw})


def test_command_results_read_as_a_shell_reports_them() -> None:
    assert command_result(result(exit_code=3, stderr="err"), 10) == CommandResult("out", "err", 3)
    assert command_result(result(exit_code=None, signal=9), None) == CommandResult("out", "", 137)
    timed = command_result(result(exit_code=None, signal=9, timed_out=True, stderr="partial"), 2)
    assert timed == CommandResult("out", "partial\nCommand timed out after 2 seconds", TIMED_OUT)
    unbounded = command_result(result(exit_code=None, signal=9, timed_out=True), None)
    assert unbounded.stderr == f"Command timed out after {MAX_EXEC:g} seconds" and unbounded.return_code == 124


def test_options_refuse_unknown_keys_and_bad_values() -> None:
    assert DsecOptions().kind == "container" and DsecOptions().output_limit == 16 << 20
    assert DsecOptions.model_validate({"kind": "microvm", "labels": {"team": "rl"}}).labels == {"team": "rl"}
    with pytest.raises(ValidationError, match="token"):
        DsecOptions.model_validate({"token": "secret"})  # the token comes from DSEC_TOKEN, never a job config
    with pytest.raises(ValidationError, match="sandbox_timeout"):
        DsecOptions.model_validate({"sandbox_timeout": 0})
    with pytest.raises(ValidationError, match="pull"):
        DsecOptions.model_validate({"pull": "never"})


def test_the_package_loads_its_helpers_without_harbor() -> None:
    import dsec.integrations.harbor as package

    assert "harbor" not in sys.modules  # mapping and options need no Harbor
    if sys.version_info < (3, 12):  # Harbor cannot be installed here: naming the class says what is missing
        with pytest.raises(ModuleNotFoundError, match=r"dsec\[harbor\]"):
            package.DsecEnvironment  # noqa: B018
