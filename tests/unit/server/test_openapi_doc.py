"""docs/openapi.json is generated from the code and must not drift from it."""

from __future__ import annotations

import json
from pathlib import Path

from dsec.server.openapi import openapi_spec

DOC = Path(__file__).resolve().parents[3] / "docs" / "openapi.json"


def test_openapi_doc_is_current() -> None:
    assert json.loads(DOC.read_text()) == json.loads(json.dumps(openapi_spec())), (
        "docs/openapi.json is stale: regenerate it with `dsec openapi --out docs/openapi.json`"
    )


def test_every_error_status_uses_the_error_model() -> None:
    spec = openapi_spec()
    create = spec["paths"]["/v1/sandboxes"]["post"]["responses"]
    for status in ("400", "401", "404", "410"):
        ref = create[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
