"""OpenAI-compatible response shapes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), the
bounded body reader and the OpenAPI document of the request models (``dmtd.serve.openai_models``)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from dmtd.serve.openai_models import ChatCompletionRequest, CompletionRequest
from dmtd.serve.requests import TooLarge

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def completion_chunk(rid: str, model: str, chat: bool, text: str, finish: str | None, first: bool) -> str:
    """One SSE ``data:`` line."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": FINISH.get(finish or "")}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH.get(finish or "")}
        obj = "text_completion"
    payload = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n"


def openai_usage(usage: dict[str, int]) -> dict[str, int]:
    u = {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0)}
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


def usage_chunk(rid: str, model: str, chat: bool, usage: dict[str, int]) -> str:
    """The last SSE chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": int(time.time()), "model": model, "choices": [],
                               "usage": openai_usage(usage)}
    return f"data: {json.dumps(payload)}\n\n"


def completion_response(rid: str, model: str, chat: bool, text: str, finish: str | None,
                        usage: dict[str, int]) -> dict[str, Any]:
    u = openai_usage(usage)
    reason = FINISH.get(finish or "stop", "stop")
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], "usage": u}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused as soon as it is known to exceed ``max_bytes`` (header or stream)."""
    too_big = TooLarge("body", f"at most {max_bytes} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


_BODIES: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest,
                                       "/v1/completions": CompletionRequest}


def install_openapi(app: FastAPI) -> None:
    """Publish the request models in ``/openapi.json`` (the routes read their bodies themselves, bounded)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                op = doc.get("paths", {}).get(path, {}).get("post")
                if op is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
