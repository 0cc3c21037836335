"""Build residue that must never reach a packed layer: package caches, temporary files, shell history, credentials.

Rules are glob patterns over paths relative to the layer root: ``*`` and ``?`` stay within one path
component and ``**/`` matches any number of leading directories. A directory that matches is dropped
whole. The list is configurable (daemon option, per call) and every packed layer reports what it dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..protocol.residue import check_rule

DEFAULT_RULES: tuple[str, ...] = (
    # temporary files
    "tmp/*",
    "var/tmp/*",
    # package manager caches and indexes
    "var/cache/apt/archives/*.deb",
    "var/cache/apt/*.bin",
    "var/lib/apt/lists/*",
    "var/cache/debconf/*-old",
    "var/log/apt/*",
    "var/log/dpkg.log",
    "**/.cache/pip",
    "**/.cache/uv",
    "**/.npm/_cacache",
    # shell and tool history
    "**/.bash_history",
    "**/.sh_history",
    "**/.zsh_history",
    "**/.ash_history",
    "**/.python_history",
    "**/.lesshst",
    "**/.viminfo",
    "**/.wget-hsts",
    # credentials
    "**/.git-credentials",
    "**/.netrc",
    "**/.pypirc",
    "**/.aws/credentials",
    "**/.docker/config.json",
    "**/.config/gh/hosts.yml",
    "**/.ssh/id_*",
    # the resolver a bootstrap or builder borrowed from the host
    "etc/resolv.conf",
    # dsec's own mount point for its in-sandbox agent
    ".dsec",
)


def _compile(pattern: str) -> re.Pattern[str]:
    check_rule(pattern)
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:[^/]+/)*")
            i += 3
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts) + r"\Z")


@dataclass
class ScrubRules:
    patterns: tuple[str, ...] = DEFAULT_RULES
    _compiled: list[re.Pattern[str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled = [_compile(p) for p in self.patterns]

    @classmethod
    def of(cls, extra: Iterable[str] = (), *, defaults: bool = True) -> ScrubRules:
        base: Sequence[str] = DEFAULT_RULES if defaults else ()
        return cls(tuple(dict.fromkeys([*base, *extra])))

    def plus(self, extra: Iterable[str], *, defaults: bool = True) -> ScrubRules:
        """These rules (the node's) and ``extra`` (a call's); ``defaults=False`` keeps only ``extra``."""
        return ScrubRules(tuple(dict.fromkeys([*(self.patterns if defaults else ()), *extra])))

    def matches(self, relpath: str) -> bool:
        return any(p.match(relpath) for p in self._compiled)
