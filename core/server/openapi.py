"""The server's OpenAPI document, with the request bodies and query parameters the routes really read.

Routes read their bodies with `parse_body` (size limit, strict pydantic model, errors in the route's
protocol), so FastAPI cannot see them; this module adds each route's body model and query parameters to
the generated document, which makes /openapi.json (and /docs) describe the API and lets a fuzzer such as
schemathesis generate real requests from it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from core.server import adapters
from core.server import anthropic_protocol as ap
from core.server import embeddings_protocol as ep
from core.server import openai_protocol as op
from core.server import responses_protocol as rp

REF_TEMPLATE = "#/components/schemas/{model}"
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": op.ChatCompletionRequest,
    "/v1/completions": op.CompletionRequest,
    "/v1/responses": rp.ResponsesRequest,
    "/v1/embeddings": ep.EmbeddingRequest,
    "/v1/score": ep.ScoreRequest,
    "/v1/rerank": ep.RerankRequest,
    "/v1/messages": ap.MessagesRequest,
    "/v1/messages/count_tokens": ap.CountTokensRequest,
    "/tokenize": op.TokenizeRequest,
    "/detokenize": op.DetokenizeRequest,
    "/abort": op.AbortRequest,
    "/v1/load_lora_adapter": adapters.LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": adapters.UnloadLoraAdapterRequest,
}
QUERY_PARAMETERS: dict[str, list[dict[str, Any]]] = {
    "/sleep": [{"name": "level", "in": "query", "required": False,
                "schema": {"type": "string", "enum": ["1", "2"]}}],
    "/wakeup": [{"name": "tags", "in": "query", "required": False, "style": "form", "explode": True,
                 "schema": {"type": "array", "items": {"type": "string", "enum": ["weights", "kv_cache"]}}}],
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for `app` plus the bodies and query parameters above (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        schema = model.model_json_schema(ref_template=REF_TEMPLATE)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        content = {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}
        document["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
    for path, parameters in QUERY_PARAMETERS.items():
        document["paths"][path]["post"]["parameters"] = parameters
    app.openapi_schema = document
    return document
