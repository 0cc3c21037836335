"""Building the container sandbox's agent: only a missing compiler is a reason to run without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.errors import BackendError, KindUnavailable
from dsec.kinds.container import agent


def test_a_source_that_does_not_compile_is_an_error_not_a_missing_facility(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "agent.c"
    broken.write_text("int main(void) { return undefined_symbol; }\n")
    monkeypatch.setattr(agent, "SOURCE", broken)
    with pytest.raises(BackendError, match="building the sandbox agent failed") as e:
        agent.build(tmp_path)
    assert not isinstance(e.value, KindUnavailable)  # the container kind would quietly drop its agent


def test_no_compiler_is_a_named_missing_facility(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with pytest.raises(KindUnavailable, match="no C compiler"):
        agent.build(tmp_path)
