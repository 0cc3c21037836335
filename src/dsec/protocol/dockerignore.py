"""``.dockerignore``: which paths of a build context are left out, by Docker's rules.

One pattern per line (``#`` starts a comment); ``*`` and ``?`` match within one path component, ``**``
any number of them, ``[...]`` a class; a leading ``!`` takes paths back in. The last pattern that matches
a path decides, and a pattern that matches a directory covers what is in it. The SDK leaves ignored
files out of the context it uploads, and the daemon applies the context's own ``.dockerignore`` again,
so a context uploaded by other means follows the same rules.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from ..errors import InvalidRequest

MAX_RULES = 4096


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    keep: bool  # a "!" line: paths it matches are taken back in


def _component(text: str) -> str:
    """One pattern (without ``**``) as a regular expression, Go's filepath.Match rules."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\" and i + 1 < len(text):
            i += 1
            out.append(re.escape(text[i]))
        elif ch == "[":
            end = text.find("]", i + 2 if text[i + 1 : i + 2] in ("^", "!") else i + 1)
            if end < 0:
                raise InvalidRequest(f".dockerignore: unterminated [ in {text[:200]!r}")
            body = text[i + 1 : end]
            body = "^" + body[1:] if body[:1] in ("^", "!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def _regex(pattern: str) -> re.Pattern[str]:
    parts = pattern.split("/")
    pieces: list[str] = []
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        if part == "**":
            pieces.append("(?:.*)" if last else "(?:[^/]+/)*")
            continue
        pieces.append(_component(part) + ("" if last else "/"))
    return re.compile("".join(pieces))


def rules(text: str) -> list[Rule]:
    """The rules of a ``.dockerignore`` file's text."""
    out: list[Rule] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        line = line[1:].strip() if keep else line
        cleaned = posixpath.normpath(line.lstrip("/")) if line.lstrip("/") else "."
        if cleaned == ".":
            continue
        out.append(Rule(_regex(cleaned), keep))
        if len(out) > MAX_RULES:
            raise InvalidRequest(f".dockerignore has over {MAX_RULES} patterns")
    return out


def ignored(path: str, ruleset: list[Rule]) -> bool:
    """Whether ``path`` (relative to the context, ``/``-separated) is left out."""
    path = posixpath.normpath(path.lstrip("/"))
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for rule in ruleset:
        if any(rule.pattern.fullmatch(p) for p in prefixes):
            verdict = not rule.keep
    return verdict
