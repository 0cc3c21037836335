"""The OpenAPI description of the E2B control routes, from their own models. The E2B app serves no
document (E2B publishes its own, which dsec follows only in part); this one states what dsec's routes
take and answer, and is what the API fuzzing of tests/integration/test_api_fuzz.py runs against.

The routes read their bodies themselves (an empty body is an empty object, as E2B's server treats it),
so each says here which model its body is; every error is E2B's ``{code, message}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from . import control_models as m

# the request models a route names (added to the document's components)
BODIES: dict[str, type[BaseModel]] = {}
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": m.Error, "description": why}
    for status, why in (
        (400, "invalid request, or something dsec's E2B API does not support"),
        (401, "missing or wrong API key"),
        (403, "the key's tenant may not do this"),
        (404, "no such sandbox, template or volume (a stopped sandbox is not found)"),
        (409, "the sandbox's state does not allow this; the volume exists, or is in use"),
        (429, "no room now on the node or in the tenant's quota"),
        (500, "the runtime failed"),
        (504, "a sandbox's agent did not answer in time"),
    )
}


def doc(
    status: int = 200,
    answer: Any = None,
    body: type[BaseModel] | None = None,
    *,
    also: dict[int, Any] | None = None,
    body_required: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of a route decorator: its success ``status`` with the ``answer`` model (None: no
    body), its request ``body`` model, the errors, and ``also`` other successes (status -> model)."""
    responses: dict[int | str, dict[str, Any]] = dict(ERRORS)
    for code, model in {status: answer, **(also or {})}.items():
        responses[code] = {"description": "Success"} if model is None else {"model": model, "description": "Success"}
    kwargs: dict[str, Any] = {"status_code": status, "responses": responses}
    if body is not None:
        BODIES[body.__name__] = body
        schema = {"$ref": f"#/components/schemas/{body.__name__}"}
        kwargs["openapi_extra"] = {
            "requestBody": {"required": body_required, "content": {"application/json": {"schema": schema}}}
        }
    return kwargs


def add_bodies(document: dict[str, Any]) -> dict[str, Any]:
    """The request models the routes name, and the models they use, in the document's components; and
    not FastAPI's 422, which this app answers as a 400."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, model in BODIES.items():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    for operations in document["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return document
