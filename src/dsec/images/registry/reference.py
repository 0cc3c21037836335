"""Image references as Docker reads them: ``[registry[:port]/]path[:tag][@sha256:hex]``.

The grammar and the normalisation follow Docker's (the ``distribution/reference`` package): a first path
component is a registry host only if it looks like one (it has a ``.`` or a ``:``, is ``localhost``, or has
an upper-case letter, which a repository may not); otherwise the registry is Docker Hub, where a
one-component name lives under ``library/``. A reference without tag or digest means ``:latest``; one with
a digest keeps the tag it was written with (if any) but is fetched by the digest.

How dsec's own image names (``dsec/busybox``) are told apart from registry references is decided by the
caller, not here: this module only reads what Docker would read.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ...errors import InvalidRequest
from ...protocol.names import DEFAULT_TAG, MAX_REFERENCE, MAX_REPOSITORY, MAX_TAG

__all__ = [
    "DOCKER_HUB",
    "Reference",
    "check_digest",
    "parse_reference",
    "split_host_port",
]

DOCKER_HUB = "docker.io"
_LEGACY_HUB = "index.docker.io"  # the old name Docker still accepts, and rewrites
_OFFICIAL = "library"

# one path component: lower-case alphanumerics joined by one '.', one or two '_', or any run of '-'
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_TAG - 1}}}")
_DOMAIN_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")
_SHA256 = re.compile(r"sha256:[a-f0-9]{64}")
# any digest the OCI grammar allows, so that an unsupported algorithm gets its own message
_ANY_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[A-Za-z0-9=_-]+")
_IMAGE_ID = re.compile(r"[a-f0-9]{64}")
_FORBIDDEN = re.compile(r"[\s\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Reference:
    """A parsed, normalised reference. ``str()`` is its canonical form (``docker.io/library/busybox:latest``).

    ``tag`` is None only when a digest is given without one; ``digest`` is ``sha256:<64 hex>`` or None."""

    registry: str
    repository: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    @property
    def name(self) -> str:
        """The repository's full name, registry included."""
        return f"{self.registry}/{self.repository}"

    @property
    def wanted(self) -> str:
        """What to ask the registry for: the digest when pinned (the tag is then only a label), else the tag."""
        if self.digest is not None:
            return self.digest
        assert self.tag is not None  # parse_reference never leaves both empty
        return self.tag

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, check_digest(digest, str(self)))

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag is not None else ""
        digest = f"@{self.digest}" if self.digest is not None else ""
        return f"{self.name}{tag}{digest}"


def parse_reference(text: str) -> Reference:
    """Read ``text`` as Docker would; InvalidRequest naming what is wrong otherwise."""
    if not isinstance(text, str) or not text:
        raise InvalidRequest("empty image reference")
    # bound the length before any pattern runs over it
    if len(text) > MAX_REFERENCE:
        raise InvalidRequest(f"image reference is {len(text)} characters, over the limit of {MAX_REFERENCE}")
    shown = repr(text)
    if _FORBIDDEN.search(text):
        raise InvalidRequest(f"image reference {shown} contains whitespace or a control character")
    if _IMAGE_ID.fullmatch(text):
        raise InvalidRequest(
            f"image reference {shown} is a 64-character hexadecimal string (an image id), not a repository name"
        )
    rest, at, digest = text.partition("@")
    if at:
        digest = check_digest(digest, f"image reference {shown}")
    name, tag = _split_tag(rest, shown)
    if not name:
        raise InvalidRequest(f"image reference {shown} names no repository")
    registry, repository = _split_registry(name)
    _check_registry(registry, shown)
    _check_repository(repository, shown)
    full = f"{registry}/{repository}"
    if len(full) > MAX_REPOSITORY:
        raise InvalidRequest(
            f"repository name {full[:60]!r}... is {len(full)} characters, over the limit of {MAX_REPOSITORY}"
        )
    if tag is None and not at:
        tag = DEFAULT_TAG
    return Reference(registry, repository, tag, digest or None)


def check_digest(digest: str, where: str) -> str:
    """``digest`` itself if it is a sha256 digest (the only algorithm registries use for pulls)."""
    if _SHA256.fullmatch(digest):
        return digest
    if not digest:
        raise InvalidRequest(f"{where}: empty digest after '@'")
    algorithm, colon, encoded = digest.partition(":")
    if colon and _ANY_DIGEST.fullmatch(digest) and algorithm != "sha256":
        raise InvalidRequest(f"{where}: digest algorithm {algorithm!r} is not supported (sha256 only)")
    if algorithm == "sha256":
        raise InvalidRequest(f"{where}: a sha256 digest is 64 lower-case hexadecimal characters, not {encoded!r}")
    raise InvalidRequest(f"{where}: invalid digest {digest!r} (expected sha256:<64 hex characters>)")


def _split_tag(rest: str, shown: str) -> tuple[str, str | None]:
    # a ':' after the last '/' starts the tag; one before it is the registry's port
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon <= slash:
        return rest, None
    name, tag = rest[:colon], rest[colon + 1 :]
    if not tag:
        raise InvalidRequest(f"image reference {shown} has an empty tag after ':'")
    if len(tag) > MAX_TAG:
        raise InvalidRequest(f"tag of {shown} is {len(tag)} characters, over the limit of {MAX_TAG}")
    if not _TAG.fullmatch(tag):
        raise InvalidRequest(
            f"invalid tag {tag!r} in {shown}: letters, digits, '_', '.' and '-', not starting with '.' or '-'"
        )
    return name, tag


def _split_registry(name: str) -> tuple[str, str]:
    first, slash, remainder = name.partition("/")
    looks_like_host = any(c in first for c in ".:") or first == "localhost" or first.lower() != first
    if not slash or not looks_like_host:
        registry, remainder = DOCKER_HUB, name
    else:
        registry = first
    if registry == _LEGACY_HUB:
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in remainder:
        remainder = f"{_OFFICIAL}/{remainder}"  # Docker Hub's official images
    return registry, remainder


def split_host_port(registry: str) -> tuple[str, int | None]:
    """``host`` (brackets kept off an IPv6 address) and the port, if one is written; ValueError if malformed."""
    if registry.startswith("["):
        end = registry.find("]")
        if end < 0:
            raise ValueError("unclosed '[' in an IPv6 address")
        host, after = registry[1:end], registry[end + 1 :]
        ipaddress.IPv6Address(host)  # only an IPv6 address goes in brackets
        if after and not after.startswith(":"):
            raise ValueError("text after the IPv6 address")
        port_text = after[1:] if after else None
    else:
        host, colon, port_text_raw = registry.partition(":")
        port_text = port_text_raw if colon else None
    if port_text is None:
        return host, None
    if not _PORT.fullmatch(port_text) or not 0 < int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} is not a number from 1 to 65535")
    return host, int(port_text)


def _check_registry(registry: str, shown: str) -> None:
    try:
        host, _ = split_host_port(registry)
    except ValueError as e:
        raise InvalidRequest(f"invalid registry {registry!r} in {shown}: {e}") from None
    if registry.startswith("["):
        return
    labels = host.split(".")
    if not all(_DOMAIN_LABEL.fullmatch(label) for label in labels):
        raise InvalidRequest(
            f"invalid registry host {host!r} in {shown}: dot-separated labels of letters, digits and inner '-'"
        )


def _check_repository(repository: str, shown: str) -> None:
    if repository.lower() != repository:
        raise InvalidRequest(f"repository name {repository!r} in {shown} must be lower-case")
    for component in repository.split("/"):
        if not component:
            raise InvalidRequest(f"repository name {repository!r} in {shown} has an empty path component")
        if not _COMPONENT.fullmatch(component):
            raise InvalidRequest(
                f"invalid path component {component!r} in {shown}: lower-case letters and digits, separated "
                "by one '.', one or two '_', or '-'s, starting and ending with a letter or digit"
            )
