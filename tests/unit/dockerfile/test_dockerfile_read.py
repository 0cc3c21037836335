"""Reading a Dockerfile: words and variables as Docker expands them, stages and their instructions, and
the settings and steps each instruction gives (no daemon: tests/integration/test_dockerfile_build.py
builds real ones)."""

from __future__ import annotations

import pytest

from dsec.core.dockerfile.parse import global_scope, parse
from dsec.core.dockerfile.stage import Copy, Run, StageReader
from dsec.core.dockerfile.words import expand, json_form, key_values, words
from dsec.errors import InvalidRequest
from dsec.images.model import ImageConfig

SCOPE = {"A": "1", "EMPTY": "", "SP": "a b"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("echo $A ${A}x", ["echo", "1", "1x"]),
        ("\"$A b\" '$A' \\$A", ["1 b", "$A", "$A"]),
        ("${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${A:+set} ${UNSET:+set}", ["d", "d", "set"]),
        ("$SP", ["a b"]),  # a value is one word: Docker does not split it again
        ('"" x', ["", "x"]),
        ("$ $1 a$", ["$", "$1", "a$"]),
        ("${A:-${SP}}${UNSET:-$A}", ["11"]),
    ],
)
def test_words_expand_as_docker_does(text: str, expected: list[str]) -> None:
    assert words(text, SCOPE) == expected


def test_no_scope_leaves_variables_and_bad_input_is_refused() -> None:
    assert words("$A ${B}", None) == ["$A", "${B}"]
    with pytest.raises(InvalidRequest, match="unterminated"):
        words('a "b', SCOPE)
    with pytest.raises(InvalidRequest, match="bad substitution"):
        expand("${A/x/y}", SCOPE)
    with pytest.raises(InvalidRequest, match="missing"):
        expand("${A", SCOPE)


def test_key_values_and_the_exec_form() -> None:
    assert key_values('A=1 B="two words" C=$A D=${SP}', SCOPE) == {"A": "1", "B": "two words", "C": "1", "D": "a b"}
    assert key_values("OLD form with $A", SCOPE) == {"OLD": "form with 1"}
    with pytest.raises(InvalidRequest):
        key_values("A=1 B", SCOPE)
    assert json_form('["/bin/sh", "-c", "x"]') == ["/bin/sh", "-c", "x"]
    assert json_form("[not json") is None and json_form('["a", 1]') is None and json_form("echo [x]") is None


DOCKERFILE = """\
# syntax=docker/dockerfile:1
ARG BASE=dsec/busybox:1
ARG VERSION
FROM ${BASE} AS build
ARG VERSION=2
ENV APP=/app \\
    MODE=dev
WORKDIR $APP
RUN echo building $VERSION > out \\
 && cat out
COPY --chown=1000:1000 --chmod=640 src/ ./src/
FROM build AS test
RUN ["/bin/true"]
FROM dsec/busybox:1
COPY --from=build /app/out /srv/out
USER 1000
ENTRYPOINT ["/bin/sh"]
CMD ["-c", "cat /srv/out"]
EXPOSE 8080 53/udp
LABEL org.example="x y"
"""


def test_stages_and_instructions() -> None:
    df = parse(DOCKERFILE)
    assert [(s.name, s.base, s.line) for s in df.stages] == [
        ("build", "${BASE}", 4),
        ("test", "build", 12),
        (None, "dsec/busybox:1", 14),
    ]
    assert [i.keyword for i in df.stages[0].instructions] == ["ARG", "ENV", "WORKDIR", "RUN", "COPY"]
    run = df.stages[0].instructions[3]
    assert run.line == 9 and run.text == "RUN echo building $VERSION > out && cat out"
    assert df.stages[0].instructions[4].flags == {"chown": "1000:1000", "chmod": "640"}
    assert global_scope(df, {}) == {"BASE": "dsec/busybox:1"}
    assert global_scope(df, {"BASE": "x:1", "VERSION": "9"}) == {"BASE": "x:1", "VERSION": "9"}
    assert df.target(None) is df.stages[2] and df.target("test") is df.stages[1]
    with pytest.raises(InvalidRequest, match="no stage named 'nope'"):
        df.target("nope")


def test_a_stage_read_instruction_by_instruction() -> None:
    df = parse(DOCKERFILE)
    base = ImageConfig(env={"PATH": "/bin"}, cmd=["sh"])
    reader = StageReader(df, df.stages[0], base, global_scope(df, {}), {"UNUSED": "x"})
    steps = [reader.step(i) for i in df.stages[0].instructions]
    run, copy = steps[3], steps[4]
    assert isinstance(run, Run) and isinstance(copy, Copy)
    assert run.argv == ["/bin/sh", "-c", "echo building $VERSION > out  && cat out"]
    assert run.env == {"VERSION": "2", "PATH": "/bin", "APP": "/app", "MODE": "dev"} and run.workdir == "/app"
    assert (copy.sources, copy.dest, copy.chown, copy.chmod, copy.into_directory) == (
        ["src/"],
        "/app/src/",
        "1000:1000",
        0o640,
        True,
    )
    last = StageReader(df, df.stages[2], base, {}, {})
    for inst in df.stages[2].instructions:
        last.step(inst)
    config = last.settings.config()
    assert (config.user, config.entrypoint, config.cmd) == ("1000", ["/bin/sh"], ["-c", "cat /srv/out"])
    assert config.exposed_ports == ["8080/tcp", "53/udp"] and config.labels == {"org.example": "x y"}


def test_a_build_arg_reaches_a_stage_only_once_declared() -> None:
    df = parse("FROM x\nRUN echo $V\nARG V\nRUN echo $V\n")
    reader = StageReader(df, df.stages[0], ImageConfig(), {}, {"V": "given"})
    first, _, second = (reader.step(i) for i in df.stages[0].instructions)
    assert isinstance(first, Run) and isinstance(second, Run)
    assert "V" not in first.env and second.env["V"] == "given"


def test_entrypoint_drops_an_inherited_cmd_and_shell_changes_the_shell_form() -> None:
    df = parse('FROM x\nSHELL ["/bin/bash", "-euc"]\nRUN echo hi\nENTRYPOINT run\n')
    reader = StageReader(df, df.stages[0], ImageConfig(cmd=["old"]), {}, {})
    steps = [reader.step(i) for i in df.stages[0].instructions]
    assert isinstance(steps[1], Run) and steps[1].argv == ["/bin/bash", "-euc", "echo hi"]
    assert reader.settings.entrypoint == ["/bin/bash", "-euc", "run"] and reader.settings.cmd is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("RUN x", "only ARG may come before the first FROM"),
        ("", "has no FROM"),
        ("FROM x\nHEALTHCHECK CMD true", "line 2: HEALTHCHECK is not supported"),
        ("FROM x\nVOLUME /data", "line 2: VOLUME is not supported"),
        ("FROM x\nONBUILD RUN x", "ONBUILD is not supported"),
        ("FROM x\nFROBNICATE y", "unknown instruction 'FROBNICATE'"),
        ("FROM x\nRUN --network=none true", "RUN --network is not supported"),
        ("FROM x\nCOPY --exclude=a . /", "COPY --exclude is not supported"),
        ("FROM x\nRUN <<EOF\necho hi\nEOF", "here-document"),
        ("FROM x AS a\nFROM y AS a", "a second stage named 'a'"),
        ("FROM --platform=linux/arm64 x", "linux/amd64 only"),
        ("FROM x y z w", "expected FROM image"),
        ("FROM x\nWORKDIR", "WORKDIR needs arguments"),
        ("FROM x\0", "NUL"),
    ],
)
def test_what_cannot_be_built_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse(text)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("ADD https://example.com/x /x", "ADD from a URL"),
        ("COPY onlyone", "needs a source and a destination"),
        ("COPY --chmod=u+x a /b", "octal mode"),
        ("USER 'a b'", "invalid user"),
        ("EXPOSE http", "invalid port"),
        ("RUN --mount=type=cache,target=/c true", "type=cache is not supported"),
        ("RUN --mount=type=secret true", "needs id=NAME"),
        ("RUN --mount=type=secret,id=x,uid=5 true", "unknown option"),
        ("SHELL /bin/bash -c", "JSON form"),
    ],
)
def test_an_instruction_dsec_cannot_follow_is_refused_with_its_line(line: str, message: str) -> None:
    df = parse(f"FROM x\n{line}\n")
    reader = StageReader(df, df.stages[0], ImageConfig(), {}, {})
    with pytest.raises(InvalidRequest, match=f"line 2 .*{message}"):
        reader.step(df.stages[0].instructions[0])


def test_a_secret_mount() -> None:
    df = parse("FROM x\nRUN --mount=type=secret,id=tok,env=TOKEN,required=true cat /run/secrets/tok\n")
    run = StageReader(df, df.stages[0], ImageConfig(), {}, {}).step(df.stages[0].instructions[0])
    assert isinstance(run, Run) and run.secret is not None
    assert (run.secret.id, run.secret.target, run.secret.env, run.secret.required) == (
        "tok",
        "/run/secrets/tok",
        "TOKEN",
        True,
    )
