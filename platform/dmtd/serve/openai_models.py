"""The OpenAI API's request bodies as pydantic models: its own field names, JSON types and ranges.

One validated model per endpoint; ``parse_body`` turns raw bytes into a :class:`ReplicaRequest` or raises
:class:`InvalidRequest` naming the field in the OpenAI API's terms (``max_tokens``, ``messages[0].content``).
DMTD extras (``top_k``, ``tau_min``, ``tau_max``, ``min_confidence``, ``user_request_id``, ``dmtd_profile``,
``repetition_penalty``, ``guided_regex``, ``guided_choice``) and vLLM's extra sampling parameters
(``dmtd.serve.openai_extras``: ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...) sit beside them; any other key
is refused, as the OpenAI API does. ``n`` copies go to the replicas as ``n`` requests (``expand``);
``response_format``, the ``guided_*`` extensions and required tool calls become a grammar (``dmtd.serve.structured``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dmtd.serve.openai_extras import ChatExtras, CompletionExtras, VllmExtras, apply_extras
from dmtd.serve.requests import (
    MAX_LOGIT_BIAS,
    MAX_NEW_TOKENS_LIMIT,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    Limits,
    validate,
)
from dmtd.serve.structured import chat_messages, grammar_for
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT, ReplicaRequest

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_N = 8
_STRICT = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1 << 16)


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=128)

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: Literal[False] | None = Field(
        None, description="vLLM extension: usage in every chunk is not served (include_usage gives it at the end)")


class _Common(VllmExtras):
    model_config = _STRICT

    model: str = Field("", max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0,
                                      description="below 0.01 (0 included) decoding is greedy")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N, description="independent samples of the prompt")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="DMTD extension (as vLLM's)")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None,
                                                                                      max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(None, max_length=4096, description="extension: the output matches the regex")
    guided_choice: list[Annotated[str, Field(max_length=256)]] | None = Field(
        None, min_length=1, max_length=64, description="extension: the output is one of these strings")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    top_k: int | None = Field(None, ge=-1, le=1 << 20, description="extension: 0 or -1 (vLLM's spelling) = off")
    tau_min: int | None = Field(None, ge=0, le=64, description="DMTD extension: lower bound of the cycle length")
    tau_max: int | None = Field(None, ge=0, le=64, description="DMTD extension: upper bound of the cycle length")
    min_confidence: float | None = Field(None, ge=0.0, le=1.0, description="DMTD extension: pin the gate")
    user_request_id: str | None = Field(None, max_length=128, description="DMTD extension: request id")
    dmtd_profile: Literal["adaptive", "quality", "balanced", "speed", "exact"] | None = Field(
        None, description="DMTD extension: cycle profile; 'exact' = verified cycles, the output is the base model's; "
        "none = the variant's default profile")


class ChatCompletionRequest(_Common, ChatExtras):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common, CompletionExtras):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or a list of token ids."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _field(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'content', 'str')`` -> ``messages[0].content`` (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or "body"


def _invalid(e: ValidationError) -> InvalidRequest:
    errors = e.errors(include_url=False, include_input=False, include_context=True)
    # of a union's member errors, one that is not a mere type mismatch says more
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    kind, field = err["type"], _field(tuple(err["loc"]))
    if kind == "json_invalid":
        detail = str((err.get("ctx") or {}).get("error", err["msg"]))
        hint = "; strings must be UTF-8 without lone surrogates" if "escape" in detail or "unicode" in detail else ""
        return InvalidRequest("body", f"is not valid JSON ({detail}{hint})")
    if kind == "extra_forbidden":
        return InvalidRequest(field, f"Unrecognized request argument supplied: {field}")
    if kind == "model_type" and field == "body":
        return InvalidRequest("body", "must be a JSON object")
    return InvalidRequest(field, err["msg"])


def _logit_bias(bias: dict[str, float] | None) -> list[tuple[int, float]]:
    out = []
    for key, value in (bias or {}).items():
        if not (key.isdigit() and int(key) < 2**31):
            raise InvalidRequest("logit_bias", f"keys must be token ids (decimal strings), got {key[:32]!r}")
        out.append((int(key), float(value)))
    return out


def _logprobs(body: _Common) -> int:
    """The replica's ``logprobs``: -1 none, else how many alternatives."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs set to true")
        return (body.top_logprobs or 0) if body.logprobs else -1
    value = getattr(body, "logprobs", None)
    return -1 if value is None else int(value)


def expand(req: ReplicaRequest, n: int) -> list[ReplicaRequest]:
    """``n`` independent copies of a request (ids ``<id>-<i>``; a seed ``s`` becomes ``s + i``); the copies after
    the first share its prefill where they reach its replica before it runs (``prefill_with``)."""
    if n == 1:
        return [req]
    return [dataclasses.replace(req, request_id=f"{req.request_id}-{i}", stop=list(req.stop),
                                logit_bias=list(req.logit_bias), prefill_with=f"{req.request_id}-0" if i else "",
                                seed=None if req.seed is None else (req.seed + i) % (MAX_SEED + 1))
            for i in range(n)]


def parse_body(raw: bytes, chat: bool, arrival_s: float, limits: Limits) -> tuple[ReplicaRequest, Any]:
    """Validate a request body; return the replica request and the validated model."""
    model_cls: type[_Common] = ChatCompletionRequest if chat else CompletionRequest
    try:
        body = model_cls.model_validate_json(raw)
    except ValidationError as e:
        raise _invalid(e) from e
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or MAX_NEW_TOKENS_DEFAULT
    req = ReplicaRequest(
        request_id=body.user_request_id or "", max_new_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0), seed=body.seed, stop=stop,
        tau_min=body.tau_min or 0, tau_max=body.tau_max or 0, min_confidence=body.min_confidence,
        profile=body.dmtd_profile or "", arrival_s=arrival_s,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, logit_bias=_logit_bias(body.logit_bias),
        grammar=grammar_for(body), logprobs=_logprobs(body),
        field_names="openai-chat" if chat else "openai-completions",
    )
    apply_extras(body, req, body.n or 1)
    if isinstance(body, ChatCompletionRequest):
        req.messages = chat_messages(body)
    elif isinstance(body, CompletionRequest):
        if isinstance(body.prompt, str):
            req.prompt = body.prompt
        elif body.prompt and isinstance(body.prompt[0], str):
            req.prompt = str(body.prompt[0])
        else:
            req.prompt_token_ids = [int(t) for t in body.prompt]
    return validate(req, limits), body
