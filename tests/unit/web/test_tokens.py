from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.web.tokens import ensure_token, read_token


def test_a_token_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "token"
    token = ensure_token(path)
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token == read_token(path)


def test_an_empty_or_unreadable_token_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(InvalidRequest, match="is empty"):
        ensure_token(tmp_path / "token")
    with pytest.raises(InvalidRequest, match="cannot read the token"):
        read_token(tmp_path / "missing")
