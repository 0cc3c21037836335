"""What a session's output is made of, as text: the prompt that ends each command, matching patterns in
the output the way pexpect does (which SWE-ReX's own shell runs on), and cleaning what an observation
shows. Pure functions and small classes, no I/O."""

from __future__ import annotations

import bisect
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

# The shell variable the driver sets to a command's token on the line that runs it (driver.sh, run)
TOKEN_VAR = "__dsec_tok"

_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")


def clean(text: str) -> str:
    """Terminal escapes out and CRLF to LF, as SWE-ReX's local runtime gives output."""
    return _ANSI.sub("", text).replace("\r\n", "\n")


def byte_length(text: str) -> int:
    """Bytes ``text`` took in the log. Exact for UTF-8 output; each undecodable byte the daemon turned
    into U+FFFD counts as 3 (the log offsets this feeds are then a little off, see session.py)."""
    return len(text.encode("utf-8", "surrogatepass"))


class Prompt:
    """The shell's PS1: ``__dsec_ps1_<nonce>_<token>_<exit status>__``. The nonce is the session's; the
    token names the command the shell ran last, so a command's own prompt cannot be mistaken for one
    that an earlier command (still running after a timeout, or interrupted) prints later."""

    def __init__(self, nonce: str) -> None:
        if not re.fullmatch(r"[0-9a-f]+", nonce):
            raise ValueError(f"a prompt nonce is hexadecimal, not {nonce!r}")
        self.prefix = f"__dsec_ps1_{nonce}_"
        self.ps1 = f"{self.prefix}${{{TOKEN_VAR}}}_$?__"
        self.any = re.compile(re.escape(self.prefix) + r"[0-9a-z]*_(\d+)__")

    def of(self, token: str) -> re.Pattern[str]:
        """The prompt that follows the command ``token``; group 1 is its exit status."""
        return re.compile(re.escape(f"{self.prefix}{token}_") + r"(\d+)__")

    def strip(self, text: str) -> str:
        return self.any.sub("", text)


def first_line(token: str, prompt: Prompt, startup_source: Sequence[str]) -> str:
    """The session's first input line: what an interactive bash reads at start (/etc/bash.bashrc where
    Debian's bash has one, then ~/.bashrc), then the request's startup files, each with stdin from
    /dev/null so that none of them can read the input meant for later commands; then the prompt."""
    rc = 'for __dsec_f in /etc/bash.bashrc ~/.bashrc; do [ -r "$__dsec_f" ] && source "$__dsec_f"; done </dev/null'
    # __dsec_ret: the driver's line for each command sets $? back to what the previous one left
    parts = [f"{TOKEN_VAR}={token}", '__dsec_ret() { return "$1"; }', rc, "unset __dsec_f"]
    parts += [f"source {shlex.quote(path)} </dev/null" for path in startup_source]
    # histexpand off: a "!" in a line typed for an interactive program must reach it untouched
    parts += [f"export PS1={shlex.quote(prompt.ps1)} PS2='' PS0=''", "set +H"]
    return "; ".join(parts)


def compile_expect(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    """``expect`` strings are regular expressions, compiled as pexpect compiles them."""
    return [re.compile(p, re.DOTALL) for p in patterns]


@dataclass(frozen=True)
class Found:
    """A match in a buffer: which pattern, where (offsets into the whole buffer), what it matched."""

    index: int
    start: int
    end: int
    text: str
    groups: tuple[str | None, ...]


def earliest(patterns: Sequence[re.Pattern[str]], text: str, pos: int = 0, offset: int = 0) -> Found | None:
    """The match that starts first in ``text[pos:]``; on a tie the pattern listed first wins (pexpect's
    rule). ``text`` begins at ``offset`` of the buffer it is cut from; the result's offsets are the buffer's."""
    best: re.Match[str] | None = None
    index = -1
    for i, pattern in enumerate(patterns):
        match = pattern.search(text, pos)
        if match is not None and (best is None or match.start() < best.start()):
            best, index = match, i
    if best is None:
        return None
    return Found(index, offset + best.start(), offset + best.end(), best.group(0), best.groups())


class Buffer:
    """Output as it arrives, kept in pieces: appending is cheap however much arrives, and a search after
    new output looks back only ``LOOKBACK`` characters before it (pexpect looks at all of it, which is
    quadratic in a long output)."""

    LOOKBACK = 64 << 10
    CONTEXT = 256

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, data: str) -> None:
        if data:
            self._pieces.append(data)
            self._starts.append(self._length)
            self._length += len(data)

    def slice(self, start: int = 0, end: int | None = None) -> str:
        end = self._length if end is None else min(end, self._length)
        if start >= end:
            return ""
        first = bisect.bisect_right(self._starts, start) - 1
        out: list[str] = []
        for piece, at in zip(self._pieces[first:], self._starts[first:], strict=True):
            if at >= end:
                break
            out.append(piece[max(0, start - at) : end - at])
        return "".join(out)

    def search(self, patterns: Sequence[re.Pattern[str]], pos: int, searched: int) -> Found | None:
        """The earliest match at or after ``pos``, given that nothing matched in the first ``searched``
        characters (a match that ends in the new output starts at most LOOKBACK before it)."""
        start = pos if searched <= pos else max(pos, searched - self.LOOKBACK)
        # the window keeps some text before where the search starts, so that ^ and lookbehinds see what
        # they would see in the whole buffer
        context = max(0, start - self.CONTEXT)
        return earliest(patterns, self.slice(context), start - context, context)


@dataclass(frozen=True)
class Header:
    """The first line a driver call writes to stdout."""

    kind: str  # "at" (the log offset its data starts at), "syntax" (bash -n's exit status), "gone"
    value: int = 0


def parse_header(line: str) -> Header | None:
    parts = line.split()
    if len(parts) == 3 and parts[0] == "dsec-swerex" and parts[1] in ("at", "syntax") and parts[2].isdigit():
        return Header(parts[1], int(parts[2]))
    if parts == ["dsec-swerex", "gone"]:
        return Header("gone")
    return None


def trailer(stderr: str) -> tuple[str, int]:
    """Why a following driver call stopped: its last ``dsec-swerex`` line on stderr ("more" with the offset
    to go on from, "gone", "broken"), or ("", 0) when it has none (the driver failed)."""
    for line in reversed(stderr.splitlines()):
        parts = line.split()
        if parts[:1] != ["dsec-swerex"] or len(parts) < 2:
            continue
        if parts[1] == "more" and len(parts) == 3 and parts[2].isdigit():
            return "more", int(parts[2])
        if parts[1] in ("gone", "broken"):
            return parts[1], 0
    return "", 0
