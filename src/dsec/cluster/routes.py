"""Which methods each path of the node API has, from its OpenAPI document: the gateway answers it for the
cluster, and a method a path does not have is a 405 that says which it has (Allow), as a node's is."""

from __future__ import annotations

import functools
import re


@functools.cache
def _table() -> list[tuple[re.Pattern[str], frozenset[str]]]:
    from ..server.app import openapi_spec

    table = []
    for template, operations in openapi_spec()["paths"].items():
        pattern = re.escape(template)
        pattern = re.sub(r"\\{[^}]*\\}", "[^/]+", pattern)  # a path parameter: one segment
        methods = {m.upper() for m in operations}
        if "GET" in methods:
            methods.add("HEAD")
        table.append((re.compile(f"^{pattern}$"), frozenset(methods)))
    return table


def allowed_methods(path: str) -> frozenset[str] | None:
    """The methods of the node API's paths that ``path`` is (None: none is; a path can match several
    templates, /v1/sandboxes/batch and /v1/sandboxes/{sandbox_id})."""
    found: set[str] = set()
    for pattern, methods in _table():
        if pattern.match(path):
            found |= methods
    return frozenset(found) if found else None
