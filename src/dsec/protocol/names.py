"""The one rule for an image name: what the wire models accept, what the store resolves and publishes,
and what the repository must be able to hold under a tag key.

A name is ``[registry/]repo[:tag][@sha256:digest]``: slash-separated lower-case path components, each
starting with a letter or a digit, an optional tag of at most 128 characters (Docker's bound), and an
optional digest. The first component names a registry when it looks like a host, as Docker decides it:
it holds a ``.`` or a ``:port``, or it is ``localhost`` (``registry.example/org/task:1``,
``127.0.0.1:5000/task``). Such a name, or one with a digest, always means that registry's image
(:func:`is_registry_reference`). A name without one is first the node's own (a built-in, a build, a
snapshot, an import); only if the node has none by that name is it Docker Hub's (``python:3.11`` is
``docker.io/library/python:3.11``), as ``docker run`` does it. The length bound is that of a full
registry reference at Docker's limits (a 255-character name, a 128-character tag and a sha256 digest).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, WithJsonSchema

from ..errors import InvalidRequest

MAX_REPOSITORY = 255  # Docker's bound for the name part (registry host and path)
MAX_TAG = 128  # Docker's bound for a tag
DIGEST_LENGTH = len("@sha256:") + 64
MAX_REFERENCE = MAX_REPOSITORY + 1 + MAX_TAG + DIGEST_LENGTH  # 456
DEFAULT_TAG = "latest"
MAX_STORED = MAX_REFERENCE + 1 + len(DEFAULT_TAG)  # a longest name without a tag, as the store keeps it

PullPolicy = Literal["if-not-present", "always"]
PULL_POLICY_DOC = (
    "When the image is a registry's: if-not-present (default) uses the node's copy when it has one and asks "
    "no registry; always asks the registry which version the tag names now and pulls it when it moved. A "
    "reference with a digest is that version either way."
)

# a registry host and port are allowed only as the first of several components
_HOST = r"(?:[a-z0-9][a-z0-9.-]*:[0-9]{1,5}/)?"
NAME_BODY = (
    _HOST + r"[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@sha256:[0-9a-f]{64})?"
)
IMAGE_NAME_PATTERN = f"^{NAME_BODY}$"
_NAME_RE = re.compile(IMAGE_NAME_PATTERN)
NAME_RULE = (
    f"[registry/]repo[:tag][@sha256:digest] (e.g. dsec/debian:12, python:3.11, registry.example:5000/org/task:1): "
    f"lower-case letters, digits and . _ - in '/'-separated parts that start with a letter or digit; the tag at "
    f"most {MAX_TAG} characters; at most {MAX_REFERENCE} characters in all"
)


def check_name(name: str, limit: int = MAX_REFERENCE) -> str:
    """The name itself, if the rule accepts it; InvalidRequest saying the rule otherwise."""
    # the length first: the pattern is then matched over a bounded string
    if not isinstance(name, str) or not 0 < len(name) <= limit or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"invalid image name {str(name)[:80]!r}: expected {NAME_RULE}")
    return name


def normalize(name: str) -> str:
    """The name as stored: with ``:latest`` when it names neither a tag nor a digest. The store normalizes
    what it is given again, so a stored name (a longest one with its default tag) passes here too."""
    check_name(name, MAX_STORED)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{DEFAULT_TAG}"


def is_registry_reference(name: str) -> bool:
    """The name means a registry's image whatever the node holds: its first component is a host (a ``.``,
    a ``:port`` or ``localhost``), or it pins a digest."""
    first, slash, _ = name.partition("/")
    host = bool(slash) and ("." in first or ":" in first or first == "localhost")
    return host or "@" in name


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
