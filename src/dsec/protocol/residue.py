"""What a client states about build residue: scrub rules (residue known by its location) and canaries
(residue known by its content). The scrubbing and the scanning are the images package's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from ..errors import InvalidRequest

MAX_RULE = 1024
MIN_CANARY = 8  # characters (as JSON Schema counts them): at least as many bytes
MAX_CANARY = 4096
MAX_CANARIES = 256


def check_rule(pattern: str) -> str:
    if not pattern or pattern.startswith("/") or len(pattern) > MAX_RULE or "\0" in pattern:
        raise InvalidRequest(f"invalid scrub rule {pattern[:80]!r}: a relative glob such as 'tmp/*' or '**/.netrc'")
    return pattern


ScrubRule = Annotated[
    str,
    AfterValidator(check_rule),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_RULE, "pattern": r"^[^/\x00][^\x00]*$"}),
]


def check_canaries(values: Iterable[str]) -> list[str]:
    """Validate canary strings (per-call lists and the daemon's ``--canary``); returns them deduplicated."""
    out: list[str] = []
    for v in values:
        if not isinstance(v, str) or "\0" in v:
            raise InvalidRequest("a canary must be a string without NUL bytes")
        n = len(v)
        if not MIN_CANARY <= n <= MAX_CANARY:
            raise InvalidRequest(f"a canary must be {MIN_CANARY} to {MAX_CANARY} characters long (got one of {n})")
        if v not in out:
            out.append(v)
    if len(out) > MAX_CANARIES:
        raise InvalidRequest(f"at most {MAX_CANARIES} canaries")
    return out


# a call's canaries on the wire: deduplicated, so at most MAX_CANARIES distinct ones (the list may repeat)
Canaries = Annotated[
    list[str],
    AfterValidator(check_canaries),
    WithJsonSchema(
        {
            "type": "array",
            "items": {"type": "string", "minLength": MIN_CANARY, "maxLength": MAX_CANARY, "pattern": r"^[^\x00]*$"},
            "maxItems": MAX_CANARIES,
            "description": f"Canary strings ({MIN_CANARY}-{MAX_CANARY} characters): the publish is refused if "
            "any layer of the image holds one.",
        }
    ),
]
