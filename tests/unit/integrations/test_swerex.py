"""The SWE-ReX integration's pure parts: the prompt and its matching, the output buffer, the driver's
headers, the argv of a one-off command, the config and a deployment that has not started."""

from __future__ import annotations

import re

import pytest
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import Command

from dsec.integrations.swerex import DsecDeployment, DsecDeploymentConfig
from dsec.integrations.swerex.output import (
    Buffer,
    Header,
    Prompt,
    clean,
    compile_expect,
    earliest,
    first_line,
    parse_header,
    trailer,
)
from dsec.integrations.swerex.runtime import command_argv, decode_text


def test_a_commands_prompt_is_its_own_and_carries_its_exit_status() -> None:
    prompt = Prompt("ab12")
    text = "out\n__dsec_ps1_ab12_t1_0__late\n__dsec_ps1_ab12_t2_130__"
    found = earliest([prompt.of("t2")], text)
    assert found is not None and found.groups == ("130",) and text[found.end :] == ""
    assert earliest([prompt.of("t3")], text) is None
    first = earliest([prompt.any], text)
    assert first is not None and first.start == 4  # any prompt: the earliest, t1's
    assert prompt.strip(text) == "out\nlate\n"
    # what `echo $PS1` shows is not a prompt
    assert earliest([prompt.any], prompt.ps1) is None
    with pytest.raises(ValueError):
        Prompt("not hex")


def test_patterns_match_as_pexpect_matches_them() -> None:
    text = "abc foo bar"
    found = earliest(compile_expect(["bar", "fo+", "o"]), text)
    assert found is not None and (found.index, found.text) == (1, "foo")
    tie = earliest(compile_expect(["foo", "f"]), text)
    assert tie is not None and tie.index == 0  # the same start: the one listed first
    assert earliest(compile_expect(["a.c"]), "a\nc") is not None  # DOTALL, as pexpect compiles
    found = earliest([re.compile("o")], text, pos=6, offset=100)
    assert found is not None and (found.start, found.end) == (106, 107)


def test_the_buffer_cuts_and_searches_across_its_pieces() -> None:
    buffer = Buffer()
    for piece in ["hel", "", "lo wo", "rld"]:
        buffer.append(piece)
    assert len(buffer) == 11 and buffer.slice() == "hello world"
    assert buffer.slice(2, 7) == "llo w" and buffer.slice(9, 100) == "ld" and buffer.slice(5, 5) == ""
    found = buffer.search([re.compile("o w")], pos=0, searched=0)
    assert found is not None and (found.start, found.text) == (4, "o w")
    assert buffer.search([re.compile("hel")], pos=1, searched=0) is None


def test_a_search_after_new_output_looks_back_a_bounded_way() -> None:
    buffer = Buffer()
    buffer.append("x" * (Buffer.LOOKBACK * 2))
    buffer.append("END")
    # a match that began long before the output that completed it is not looked for again
    assert buffer.search([re.compile("x{10}END")], pos=0, searched=len(buffer) - 3) is not None
    assert buffer.search([re.compile("^x")], pos=0, searched=len(buffer) - 3) is None
    assert buffer.search([re.compile("^x")], pos=0, searched=0) is not None


def test_output_is_cleaned_as_swe_rex_cleans_it() -> None:
    assert clean("\x1b[1;31mred\x1b[0m\r\nnext\r\n") == "red\nnext\n"


def test_the_first_line_reads_the_rc_files_and_startup_files_without_its_input() -> None:
    prompt = Prompt("ff")
    line = first_line("t0", prompt, ["/root/.bashrc", "/opt/it's.sh"])
    assert line.startswith("__dsec_tok=t0; ")
    assert "source /root/.bashrc </dev/null" in line and "source '/opt/it'\"'\"'s.sh' </dev/null" in line
    assert "/etc/bash.bashrc ~/.bashrc" in line and "\n" not in line
    assert line.endswith("set +H") and "PS1='__dsec_ps1_ff_${__dsec_tok}_$?__'" in line


def test_driver_headers_and_trailers() -> None:
    assert parse_header("dsec-swerex at 42") == Header("at", 42)
    assert parse_header("dsec-swerex syntax 2") == Header("syntax", 2)
    assert parse_header("dsec-swerex gone") == Header("gone")
    for bad in ["", "dsec-swerex at", "dsec-swerex at x", "bash: oops", "dsec-swerex more 3"]:
        assert parse_header(bad) is None, bad
    assert trailer("noise\ndsec-swerex more 4096\n") == ("more", 4096)
    assert trailer("dsec-swerex gone\n") == ("gone", 0)
    assert trailer("tail: oops\ndsec-swerex broken\n") == ("broken", 0)
    assert trailer("bash: driver: No such file or directory\n") == ("", 0)


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        (Command(command=["ls", "-l"]), ["ls", "-l"]),
        # a string without a shell is a program's name, as subprocess takes it
        (Command(command="ls -l"), ["ls -l"]),
        (Command(command="echo $HOME", shell=True), ["/bin/sh", "-c", "echo $HOME"]),
        # a list with a shell: the script, then its $0 and arguments
        (Command(command=["echo $0 $1", "zero", "one"], shell=True), ["/bin/sh", "-c", "echo $0 $1", "zero", "one"]),
        (Command(command=["ls"], merge_output_streams=True), ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", "ls"]),
        # env replaces the whole environment, as subprocess's env does
        (Command(command=["ls"], env={"A": "1", "B": "x y"}), ["env", "-i", "A=1", "B=x y", "ls"]),
        (Command(command=["ls"], env={}), ["env", "-i", "ls"]),
    ],
)
def test_a_one_off_commands_argv_is_what_subprocess_would_run(command: Command, argv: list[str]) -> None:
    assert command_argv(command) == argv


def test_files_read_as_path_read_text_reads_them() -> None:
    assert decode_text(b"a\r\nb\rc\n", None, None) == "a\nb\nc\n"
    assert decode_text("é".encode("latin-1"), "latin-1", None) == "é"
    assert decode_text(b"\xff", None, "replace") == "\ufffd"
    with pytest.raises(UnicodeDecodeError):
        decode_text(b"\xff", None, None)


def test_the_config_is_a_swe_rex_deployment_config() -> None:
    config = DsecDeploymentConfig(image="dsec/debian:12", memory="1Gi", labels={"job": "7"}, token="secret")
    assert config.type == "dsec" and "secret" not in repr(config)
    args = config.sandbox_args()
    assert args["labels"] == {"dsec.integration": "swe-rex", "job": "7"} and args["memory"] == "1Gi"
    assert DsecDeploymentConfig.model_validate(config.model_dump()) == config
    assert DsecDeploymentConfig(create_args={"pids": 64}).sandbox_args()["pids"] == 64
    for taken in ["image", "client", "trajectory"]:
        with pytest.raises(ValueError, match=taken):
            DsecDeploymentConfig(create_args={taken: "x"})
    with pytest.raises(ValueError):
        DsecDeploymentConfig(type="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DsecDeploymentConfig(imagee="x")  # type: ignore[call-arg]
    assert isinstance(config.get_deployment(), DsecDeployment)


async def test_a_deployment_that_has_not_started_is_not_alive_and_has_no_runtime() -> None:
    deployment = DsecDeploymentConfig().get_deployment()
    assert not await deployment.is_alive()
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime  # noqa: B018
    await deployment.stop()  # nothing to stop: not an error
    assert deployment.sandbox_id is None
