"""The methods each path of the node API has, from its OpenAPI document: what a 405's Allow header lists
(RFC 9110: every method of the resource; a router names only those of the first route it matched, and
the gateway, which answers the node API for a cluster, has no router). A path can be several templates:
/v1/sandboxes/batch is also /v1/sandboxes/{sandbox_id}."""

from __future__ import annotations

import functools
import re

from .openapi import openapi_spec


@functools.cache
def _table() -> list[tuple[re.Pattern[str], bool, frozenset[str]]]:
    table = []
    for template, operations in openapi_spec()["paths"].items():
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template))  # a path parameter: one segment
        methods = {m.upper() for m in operations}
        if "GET" in methods:
            methods.add("HEAD")
        table.append((re.compile(f"^{pattern}$"), "{" not in template, frozenset(methods)))
    return table


def routed(path: str, method: str) -> bool | None:
    """Whether some path of the node API that ``path`` is has ``method`` (None: it is none of them)."""
    matches = [methods for pattern, _, methods in _table() if pattern.match(path)]
    return any(method in methods for methods in matches) if matches else None


def allowed_methods(path: str) -> frozenset[str] | None:
    """The methods of the resource ``path`` names, for an Allow header: a literal path's own (as OpenAPI
    prefers it to a template that also matches), else those of the templates it matches."""
    matches = [(literal, methods) for pattern, literal, methods in _table() if pattern.match(path)]
    if not matches:
        return None
    literal = [methods for is_literal, methods in matches if is_literal]
    return frozenset().union(*(literal or [methods for _, methods in matches]))
