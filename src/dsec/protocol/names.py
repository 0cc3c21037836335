"""The one rule for an image name: what the wire models accept, what the store resolves and publishes,
and what the repository must be able to hold under a tag key.

A name is ``repo[:tag]``: slash-separated lower-case path components, each starting with a letter or
a digit, and an optional tag of at most 128 characters (Docker's bound). The length bound is that of a
full registry reference at Docker's limits (a 255-character name, a 128-character tag and a sha256
digest), so that references naming a registry fit the same wire fields and the same tag store when
they are accepted; today a registry host (``host:5000/...``) and a digest (``@sha256:...``) are not.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from ..errors import InvalidRequest

MAX_REPOSITORY = 255  # Docker's bound for the name part (registry host and path)
MAX_TAG = 128  # Docker's bound for a tag
DIGEST_LENGTH = len("@sha256:") + 64
MAX_REFERENCE = MAX_REPOSITORY + 1 + MAX_TAG + DIGEST_LENGTH  # 456
DEFAULT_TAG = "latest"
MAX_STORED = MAX_REFERENCE + 1 + len(DEFAULT_TAG)  # a longest name without a tag, as the store keeps it

NAME_BODY = r"[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?"
IMAGE_NAME_PATTERN = f"^{NAME_BODY}$"
_NAME_RE = re.compile(IMAGE_NAME_PATTERN)
NAME_RULE = (
    f"repo[:tag] (e.g. dsec/debian:12): lower-case letters, digits and . _ - in '/'-separated parts that start "
    f"with a letter or digit; the tag at most {MAX_TAG} characters; at most {MAX_REFERENCE} characters in all"
)


def check_name(name: str, limit: int = MAX_REFERENCE) -> str:
    """The name itself, if the rule accepts it; InvalidRequest saying the rule otherwise."""
    # the length first: the pattern is then matched over a bounded string
    if not isinstance(name, str) or not 0 < len(name) <= limit or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"invalid image name {str(name)[:80]!r}: expected {NAME_RULE}")
    return name


def normalize(name: str) -> str:
    """The name as stored: with ``:latest`` when it names no tag. The store normalizes what it is given
    again, so a stored name (a longest one with its default tag) passes here too."""
    check_name(name, MAX_STORED)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{DEFAULT_TAG}"


IMAGE_NAME_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_REFERENCE,
    "pattern": IMAGE_NAME_PATTERN,
    "description": f"Image name, {NAME_RULE}.",
}
ImageName = Annotated[str, AfterValidator(check_name), WithJsonSchema(IMAGE_NAME_SCHEMA)]


TENANT_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"
_TENANT_RE = re.compile(TENANT_NAME)


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or not _TENANT_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid tenant name {str(name)[:80]!r}: 1-63 characters of a-z, 0-9 and '-', starting with a letter "
            "or digit"
        )
    return name


TenantName = Annotated[
    str,
    AfterValidator(check_tenant_name),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 63, "pattern": TENANT_NAME}),
]
