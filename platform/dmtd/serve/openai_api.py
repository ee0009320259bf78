"""OpenAI-compatible request/response shapes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)."""

from __future__ import annotations

import json
import time
from typing import Any

from dmtd.serve.requests import InvalidRequest, ReplicaRequest, validate

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def _num(body: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidRequest(key, f"must be a {kind.__name__}")


def to_replica_request(body: dict[str, Any], chat: bool, arrival_s: float) -> ReplicaRequest:
    """Validate an OpenAI request body (plus DMTD extras: tau_min, tau_max, min_confidence)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    if _num(body, "n", 1, int) != 1:
        raise InvalidRequest("n", "only n = 1 is supported")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop", "must be a string or a list of strings")
    req = ReplicaRequest(
        request_id=str(body.get("user_request_id") or ""),
        max_new_tokens=_num(body, "max_completion_tokens", _num(body, "max_tokens", 128, int), int),
        temperature=_num(body, "temperature", 1.0, float), top_p=_num(body, "top_p", 1.0, float),
        top_k=_num(body, "top_k", 0, int), seed=body.get("seed"), stop=stop,
        tau_min=_num(body, "tau_min", 0, int), tau_max=_num(body, "tau_max", 0, int),
        min_confidence=body.get("min_confidence"), arrival_s=arrival_s,
    )
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequest("messages", "must be a non-empty list")
        req.messages = [{"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in msgs]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            req.prompt_token_ids = prompt
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            req.prompt = prompt[0]
        elif isinstance(prompt, str):
            req.prompt = prompt
        else:
            raise InvalidRequest("prompt", "must be a string, a list of one string, or a list of token ids")
    return validate(req)


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


def completion_response(rid: str, model: str, chat: bool, text: str, finish: str | None,
                        usage: dict[str, int]) -> dict[str, Any]:
    u = {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0)}
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    reason = FINISH.get(finish or "stop", "stop")
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], "usage": u}


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
