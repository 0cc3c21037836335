"""Image references read as Docker reads them (dsec.images.registry.reference)."""

from __future__ import annotations

import pytest

from dsec.errors import InvalidRequest
from dsec.images.registry.reference import Reference, parse_reference

D = "sha256:" + "0123456789abcdef" * 4

GOOD = [
    # Docker Hub: the default registry, official images under library/, the default tag
    ("busybox", "docker.io", "library/busybox", "latest", None),
    ("busybox:1.36", "docker.io", "library/busybox", "1.36", None),
    ("docker.io/busybox", "docker.io", "library/busybox", "latest", None),
    ("docker.io/library/busybox", "docker.io", "library/busybox", "latest", None),
    ("index.docker.io/library/busybox:1", "docker.io", "library/busybox", "1", None),
    (
        "swebench/sweb.eval.x86_64.django__django-11099:latest",
        "docker.io",
        "swebench/sweb.eval.x86_64.django__django-11099",
        "latest",
        None,
    ),
    # a first component without '.' or ':' is a Docker Hub user, not a host
    ("myhost/app", "docker.io", "myhost/app", "latest", None),
    # registries: a '.', a port, localhost, an IP address or an upper-case first component makes it a host
    ("quay.io/org/app:v1", "quay.io", "org/app", "v1", None),
    ("registry.example:5000/org/team/app", "registry.example:5000", "org/team/app", "latest", None),
    ("localhost/app", "localhost", "app", "latest", None),
    ("localhost:5000/app:t", "localhost:5000", "app", "t", None),
    ("127.0.0.1:5000/a/b", "127.0.0.1:5000", "a/b", "latest", None),
    ("[::1]:5000/app", "[::1]:5000", "app", "latest", None),
    ("[fe80::1]/app", "[fe80::1]", "app", "latest", None),
    ("Registry/app", "Registry", "app", "latest", None),
    # a colon without a later '/' is a tag, even when it looks like a port
    ("host:5000", "docker.io", "library/host", "5000", None),
    # digests: a digest alone leaves no tag; with a tag both are kept (the digest is fetched)
    (f"busybox@{D}", "docker.io", "library/busybox", None, D),
    (f"quay.io/org/app:v1@{D}", "quay.io", "org/app", "v1", D),
    (f"localhost:5000/app@{D}", "localhost:5000", "app", None, D),
    # separators: one '.', one or two '_', any run of '-'
    ("x/a.b/c__d/e---f", "docker.io", "x/a.b/c__d/e---f", "latest", None),
    ("a.b/c", "a.b", "c", "latest", None),
    ("x/y_z:TAG_1.0-rc", "docker.io", "x/y_z", "TAG_1.0-rc", None),
    ("x:_tag", "docker.io", "library/x", "_tag", None),
    ("x:" + "t" * 128, "docker.io", "library/x", "t" * 128, None),
]


@pytest.mark.parametrize(("text", "registry", "repository", "tag", "digest"), GOOD)
def test_good_references(text: str, registry: str, repository: str, tag: str | None, digest: str | None) -> None:
    ref = parse_reference(text)
    assert ref == Reference(registry, repository, tag, digest)
    # the canonical form reads back as itself
    assert parse_reference(str(ref)) == ref


def test_canonical_forms() -> None:
    assert str(parse_reference("busybox")) == "docker.io/library/busybox:latest"
    assert str(parse_reference(f"busybox@{D}")) == f"docker.io/library/busybox@{D}"
    assert str(parse_reference(f"h:1/a:t@{D}")) == f"h:1/a:t@{D}"
    ref = parse_reference("quay.io/org/app:v1")
    assert ref.name == "quay.io/org/app"
    assert ref.wanted == "v1"
    assert ref.with_digest(D).wanted == D


BAD = [
    ("", "empty image reference"),
    ("UPPER", "must be lower-case"),
    ("org/App", "must be lower-case"),
    ("quay.io/Org/app", "must be lower-case"),
    ("x:", "empty tag"),
    ("x:-tag", "invalid tag '-tag'"),
    ("x:.tag", "invalid tag '.tag'"),
    ("x:t" + "a" * 128, "over the limit of 128"),
    ("x:t@g", "invalid digest 'g'"),
    ("x@", "empty digest"),
    ("x@sha256:abc", "64 lower-case hexadecimal"),
    ("x@sha256:" + "A" * 64, "64 lower-case hexadecimal"),
    ("x@sha512:" + "a" * 128, "'sha512' is not supported"),
    ("x@md5", "invalid digest"),
    (f"@{D}", "names no repository"),
    ("0123456789abcdef" * 4, "an image id"),
    ("a//b", "empty path component"),
    ("a/", "empty path component"),
    ("/a", "empty path component"),
    ("-a", "invalid path component '-a'"),
    ("a-", "invalid path component 'a-'"),
    ("a_", "invalid path component 'a_'"),
    ("a___b", "invalid path component 'a___b'"),
    ("a..b", "invalid path component 'a..b'"),
    ("a/b$c", "invalid path component 'b$c'"),
    ("ho_st.io/a", "invalid registry host 'ho_st.io'"),
    ("-host.io/a", "invalid registry host '-host.io'"),
    ("host.io:99999/a", "from 1 to 65535"),
    ("host.io:0/a", "from 1 to 65535"),
    ("host.io:x5/a:t", "invalid registry 'host.io:x5'"),
    ("[::1/a", "unclosed '['"),
    ("[nothex]:5/a", "invalid registry"),
    ("a b", "whitespace or a control character"),
    ("a\nb", "whitespace or a control character"),
    ("x/" + "a" * 300, "over the limit of 255"),
    ("a" * 457, "over the limit of 456"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_references(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_reference(text)
    assert message in str(info.value)


def test_repository_length_bound_counts_the_registry() -> None:
    # 255 characters of registry and path in all, as Docker counts them after normalising
    path = "a" * (255 - len("docker.io/x/"))
    assert parse_reference(f"x/{path}").repository == f"x/{path}"
    with pytest.raises(InvalidRequest, match="over the limit of 255"):
        parse_reference(f"x/{path}a")


def test_not_a_string_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        parse_reference(None)  # type: ignore[arg-type]
