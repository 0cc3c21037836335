"""Words of a Dockerfile instruction, as Docker reads them: quotes, the escape character, and variables
(``$VAR``, ``${VAR}``, ``${VAR:-word}``, ``${VAR:+word}``; none inside single quotes).

dockerfile-parse splits a file into instructions; this module gives their arguments meaning, since its
own word splitter knows neither ``${VAR:-word}`` nor an unset variable's default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ...errors import InvalidRequest

NAME_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
NAME_CHARS = NAME_START + "0123456789"


class Lexer:
    """One instruction's argument text, read into words with ``scope``'s variables expanded."""

    def __init__(self, text: str, scope: Mapping[str, str] | None, escape: str = "\\") -> None:
        self.text = text
        self.scope = scope  # None: no expansion at all
        self.escape = escape
        self.pos = 0

    def _peek(self, n: int = 0) -> str:
        i = self.pos + n
        return self.text[i] if i < len(self.text) else ""

    def words(self, split: bool = True) -> list[str]:
        out: list[str] = []
        word: list[str] | None = None
        quote = ""
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if ch == self.escape and quote != "'":
                nxt = self._peek()
                self.pos += 1 if nxt else 0
                # inside double quotes only a quote, the escape or $ is escaped; else both stay
                keep = nxt if not quote or nxt in ('"', self.escape, "$") else ch + nxt
                word = [*(word or []), keep]
                continue
            if ch in "'\"" and (not quote or quote == ch):
                quote = "" if quote else ch
                word = word or []  # "" is a word
                continue
            if ch == "$" and quote != "'" and self.scope is not None:
                value = self._variable()
                if value or word is not None:  # an empty expansion outside quotes makes no word
                    word = [*(word or []), value]
                continue
            if split and not quote and ch.isspace():
                if word is not None:
                    out.append("".join(word))
                word = None
                continue
            word = [*(word or []), ch]
        if quote:
            raise InvalidRequest(f"unterminated {quote} quote in {self.text[:200]!r}")
        if word is not None:
            out.append("".join(word))
        return out

    def _variable(self) -> str:
        assert self.scope is not None
        if self._peek() == "{":
            end = self._closing(self.pos)
            body = self.text[self.pos + 1 : end]
            self.pos = end + 1
            return self._braced(body)
        start = self.pos
        if self._peek() in NAME_START and self._peek():
            while self._peek() and self._peek() in NAME_CHARS:
                self.pos += 1
        name = self.text[start : self.pos]
        if not name:
            return "$"
        return self.scope.get(name, "")

    def _closing(self, start: int) -> int:
        """Where the ``}`` closing the ``${`` at ``start`` is (nested ones counted)."""
        depth = 0
        for i in range(start, len(self.text)):
            if self.text[i] == "{" and self.text[i - 1] == "$":
                depth += 1
            elif self.text[i] == "}":
                depth -= 1
                if depth == 0:
                    return i
        raise InvalidRequest(f"missing '}}' in {self.text[:200]!r}")

    def _braced(self, body: str) -> str:
        assert self.scope is not None
        for op in (":-", ":+", "-", "+"):
            name, sep, word = body.partition(op)
            if sep and _is_name(name):
                value = self.scope.get(name)
                alternative = "".join(Lexer(word, self.scope, self.escape).words(split=False))
                if op.endswith("-"):
                    unset = value is None or (op == ":-" and value == "")
                    return alternative if unset else str(value)
                isset = value is not None and (op == "+" or value != "")
                return alternative if isset else ""
        if not _is_name(body):
            raise InvalidRequest(
                f"bad substitution ${{{body[:80]}}}: dsec knows ${{NAME}}, ${{NAME:-word}}, ${{NAME:+word}}"
            )
        return self.scope.get(body, "")


def _is_name(name: str) -> bool:
    return bool(name) and name[0] in NAME_START and all(c in NAME_CHARS for c in name)


def words(text: str, scope: Mapping[str, str] | None = None, escape: str = "\\") -> list[str]:
    """The words of ``text``, variables expanded from ``scope`` (None: left as written)."""
    return Lexer(text, scope, escape).words()


def expand(text: str, scope: Mapping[str, str], escape: str = "\\") -> str:
    """``text`` as one word: quotes removed, variables expanded (WORKDIR, USER, a stage's base image)."""
    return "".join(Lexer(text, scope, escape).words(split=False))


def json_form(text: str) -> list[str] | None:
    """The exec form (a JSON array of strings) of RUN, CMD, ENTRYPOINT, SHELL, COPY and ADD, or None for
    the shell form (Docker's rule: what does not parse as such an array is a shell command)."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return None
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def key_values(text: str, scope: Mapping[str, str], escape: str = "\\") -> dict[str, str]:
    """ENV and LABEL: ``k=v k2="v 2"``, or the old ``k some value`` form (one pair, the rest the value)."""
    raw = split_raw(text, escape)
    if not raw:
        raise InvalidRequest("expected name=value")
    if "=" not in raw[0]:
        name, _, rest = text.strip().partition(" ")
        if not rest.strip():
            raise InvalidRequest(f"{name!r} has no value (write {name}=value)")
        return {expand(name, scope, escape): expand(rest.strip(), scope, escape)}
    pairs: dict[str, str] = {}
    for word in raw:
        name, eq, value = word.partition("=")
        if not eq:
            raise InvalidRequest(f"{word!r} is not name=value")
        pairs[expand(name, scope, escape)] = expand(value, scope, escape)
    return pairs


def split_raw(text: str, escape: str = "\\") -> list[str]:
    """Words split at white space outside quotes, each kept as written (quotes and escapes in place), for
    what is expanded piece by piece (``name=value`` pairs, an instruction's ``--flags``)."""
    out: list[str] = []
    word: list[str] = []
    quote = ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == escape and quote != "'" and i + 1 < len(text):
            word += [ch, text[i + 1]]
            i += 2
            continue
        if ch in "'\"" and (not quote or quote == ch):
            quote = "" if quote else ch
        if ch.isspace() and not quote:
            if word:
                out.append("".join(word))
            word = []
        else:
            word.append(ch)
        i += 1
    if quote:
        raise InvalidRequest(f"unterminated {quote} quote in {text[:200]!r}")
    if word:
        out.append("".join(word))
    return out
