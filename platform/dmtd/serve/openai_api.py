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

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop", "tool_calls": "tool_calls"}


def _token(entry: Any) -> tuple[str, list[int]]:
    raw = bytes(entry[1])
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion: one item per token, with its ``top_logprobs``."""
    content = []
    for e in entries:
        text, raw = _token(e)
        top = [{"token": _token(t)[0], "logprob": float(t[2]), "bytes": _token(t)[1]} for t in e[3]]
        content.append({"token": text, "logprob": float(e[2]), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Any], offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a (legacy) completion; ``offset``: where the first token's text starts."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(_token(e)[0])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [float(e[2]) for e in entries],
            "top_logprobs": [{_token(t)[0]: float(t[2]) for t in e[3]} for e in entries], "text_offset": offsets}


def completion_chunk(rid: str, model: str, chat: bool, text: str, finish: str | None, first: bool,
                     index: int = 0, logprobs: dict[str, Any] | None = None,
                     tool_calls: list[dict[str, Any]] | None = None) -> str:
    """One SSE ``data:`` line."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if tool_calls is not None:
            delta["content"] = None
            delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(tool_calls)]
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": FINISH.get(finish or "")}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": FINISH.get(finish or "")}
        obj = "text_completion"
    payload = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n"


def openai_usage(usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI's usage; ``completion_tokens_details`` also carries the exact profile's drafted and accepted
    draft tokens (extension fields)."""
    u: dict[str, Any] = {"prompt_tokens": usage.get("prompt_tokens", 0),
                         "completion_tokens": usage.get("completion_tokens", 0)}
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    u["prompt_tokens_details"] = {"cached_tokens": usage.get("cached_tokens", 0), "audio_tokens": 0}
    u["completion_tokens_details"] = {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0,
                                      "drafted_tokens": usage.get("drafted_tokens", 0),
                                      "accepted_tokens": usage.get("accepted_tokens", 0)}
    return u


def usage_chunk(rid: str, model: str, chat: bool, usage: dict[str, int]) -> str:
    """The last SSE chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": int(time.time()), "model": model, "choices": [],
                               "usage": openai_usage(usage)}
    return f"data: {json.dumps(payload)}\n\n"


def completion_choice(chat: bool, index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None,
                      tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a whole (not streamed) response."""
    reason = "tool_calls" if tool_calls else FINISH.get(finish or "stop", "stop")
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls else text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def completion_response(rid: str, model: str, chat: bool, choices: list[dict[str, Any]],
                        usage: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": openai_usage(usage)}


def model_profile(info: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/models`` entry's ``dmtd`` extension: the variant's profile (``dmtd_profile`` values it serves)."""
    keys = ("base_model", "default_profile", "verifier", "tau_min", "tau_max", "default_tau", "min_confidence",
            "num_decoding_layers", "traffic_weight")
    out = {k: info[k] for k in keys if info.get(k) not in (None, "")}
    out.setdefault("default_profile", "dmtd")
    out["profiles"] = ["adaptive", "quality", "balanced", "speed", "exact"]
    return out


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
