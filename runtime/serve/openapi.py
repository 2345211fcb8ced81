"""The OpenAPI schema of the app's routes that read and validate their JSON bodies themselves.

``body_schema`` declares a route's request body from its pydantic model; ``openapi_schema``
adds those models to FastAPI's schema (cached on the app).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = ["body_schema", "openapi_schema"]

_SCHEMA_DEFS: dict[str, Any] = {}
"""Models referenced by the request bodies' schemas (filled as routes are declared)."""


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that reads and validates its JSON body itself."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request models our bodies refer to (cached on the app)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
        app.openapi_schema = schema
    return app.openapi_schema
