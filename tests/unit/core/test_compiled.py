"""The language table and how a step's end is told (core/compiled.py): a missing program from a program
that exits 127 by itself, a timeout; the table's names as the wire's Literal states them."""

from __future__ import annotations

from typing import get_args

import pytest

from dsec.core.compiled import classify, language
from dsec.errors import InvalidRequest
from dsec.protocol.languages import LANGUAGES, LanguageName
from dsec.protocol.sandbox import ExecResult


def test_classify_tells_a_missing_program_from_a_program_that_exits_127() -> None:
    def res(code: int, stderr: str, timed_out: bool = False) -> ExecResult:
        return ExecResult(exit_code=code, stderr=stderr, timed_out=timed_out)

    assert classify(res(127, "dsec: cannot run node: No such file or directory\n"), "node").status == "error"
    assert classify(res(127, "node: something else\n"), "node").status == "finished"
    assert classify(res(127, "dsec: cannot run node: No such file or directory\n"), "./main").status == "finished"
    assert classify(res(137, "", timed_out=True), "./main").status == "timeout"


def test_the_language_table() -> None:
    assert set(get_args(LanguageName)) == set(LANGUAGES)
    assert {"python", "bash", "cpp", "go", "java", "nodejs"} <= set(LANGUAGES)
    java = LANGUAGES["java"]
    assert java.source == "Main.java" and java.compile is not None
    assert "-XX:MaxRAM=536870912" in java.argv(java.run, 512 << 20)
    assert all("{" not in a for lang in LANGUAGES.values() for a in lang.argv(lang.run, 1))
    with pytest.raises(InvalidRequest, match="'rust' is not supported"):
        language("rust")
