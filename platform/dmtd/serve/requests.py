"""Request validation and conversion from the wire format (protobuf) into ``ReplicaRequest`` (dmtd_contract).

Validation happens at the gateway, before a request takes a queue slot; every error names the field and
the rule (it becomes gRPC ``INVALID_ARGUMENT`` / HTTP 400).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dmtd.engine.sequence import RequestError
from dmtd.serve.errors import InvalidRequest, RequestFailed, TooLarge
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT, ReplicaRequest

__all__ = ["FIELD_NAMES", "GRPC_NAMES", "OPENAI_CHAT_NAMES", "OPENAI_COMPLETION_NAMES", "FieldNames", "InvalidRequest",
           "Limits", "TooLarge", "check_types", "from_proto", "names_of", "refused", "validate"]

PROFILES = {0: "", 1: "quality", 2: "balanced", 3: "speed", 4: "exact", 5: "adaptive"}  # "": the variant's default
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_GRAMMAR_CHARS = 1 << 17


class Limits(BaseModel):
    """Size limits checked at the edges before a request reaches a replica (``build_app(limits=...)``)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="HTTP body / serialized gRPC request, bytes")
    max_prompt_chars: int = Field(default=65536, ge=1, description="prompt, or all chat contents together, characters "
                                                            "(checked before tokenising); also caps prompt token ids")
    max_messages: int = Field(default=256, ge=1, description="chat messages per request")


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How one API names the request's fields. A refusal names the field in the caller's own terms wherever it is
    raised (validation at the gateway and again at the replica, tokenising, admission): the request carries its
    API (``ReplicaRequest.field_names``), and :func:`names_of` gives its names — the gRPC API's
    ``sampling.temperature``, ``chat.messages[0].content``; the OpenAI API's ``temperature``,
    ``messages[0].content``, ``max_tokens``."""

    sampling: str = "sampling."  # before a sampling field's name
    cycle: str = "cycle."  # before a cycle field's name
    messages: str = "chat.messages"
    max_new_tokens: str = "max_new_tokens"
    input: str = "input"  # the input as a whole, when none is given
    prompt: str = "prompt"
    prompt_token_ids: str = "prompt_token_ids"
    request_id: str = "request_id"
    profile: str = "cycle.profile"
    grammar: str = "json_schema"
    logprobs: str = "logprobs"

    def of(self, name: str) -> str:
        """The API's name of a request field named as the replica request or the engine name it (``temperature``,
        ``max_new_tokens``, ``messages[0].content``; the engine's ``top_logprobs``, ``response_format``), with any
        index or sub-field after it kept. The input as a whole (the engine's ``prompt``) is :meth:`input_of`'s."""
        cut = min((i for i in (name.find("["), name.find(".")) if i > 0), default=len(name))
        head, rest = name[:cut], name[cut:]
        if head == "chat" and rest.startswith(".messages"):
            head, rest = "messages", rest[len(".messages"):]
        if head in _SAMPLING:
            return self.sampling + name
        if head in _CYCLE:
            return self.cycle + name
        own = {"messages": self.messages, "max_new_tokens": self.max_new_tokens, "prompt": self.prompt,
               "prompt_token_ids": self.prompt_token_ids, "request_id": self.request_id, "profile": self.profile,
               "grammar": self.grammar, "response_format": self.grammar, "logprobs": self.logprobs,
               "top_logprobs": self.logprobs}
        return own.get(head, head) + rest

    def input_of(self, req: ReplicaRequest) -> str:
        """The API's name of the request's input as a whole: its chat messages, prompt token ids or prompt."""
        return self.messages if req.messages else self.prompt_token_ids if req.prompt_token_ids else self.prompt


_SAMPLING = {"temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias"}
_CYCLE = {"tau_min", "tau_max", "min_confidence"}
GRPC_NAMES = FieldNames()
OPENAI_CHAT_NAMES = FieldNames(sampling="", cycle="", messages="messages", max_new_tokens="max_tokens",
                               input="messages", prompt="messages", prompt_token_ids="messages",
                               request_id="user_request_id", profile="dmtd_profile", grammar="response_format",
                               logprobs="top_logprobs")
OPENAI_COMPLETION_NAMES = dataclasses.replace(OPENAI_CHAT_NAMES, input="prompt", prompt="prompt",
                                              prompt_token_ids="prompt", logprobs="logprobs")
FIELD_NAMES = {"grpc": GRPC_NAMES, "openai-chat": OPENAI_CHAT_NAMES, "openai-completions": OPENAI_COMPLETION_NAMES}


def names_of(req: ReplicaRequest) -> FieldNames:
    """The names of the API the request came in by (``ReplicaRequest.field_names``; gRPC's if it names none
    known)."""
    return FIELD_NAMES.get(req.field_names, GRPC_NAMES) if isinstance(req.field_names, str) else GRPC_NAMES


def refused(req: ReplicaRequest, e: RequestError) -> RequestFailed:
    """The engine's refusal of a request (it names its own parameter: ``temperature``, ``prompt``) as the replica's,
    in the names of the request's API."""
    n = names_of(req)
    name = n.input_of(req) if e.field in ("prompt", "input") else n.of(e.field)
    return RequestFailed(name, f"{name}: {e.rule}")


_NUM = (int, float)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,), "prompt": (str, type(None)), "messages": (list, type(None)),
    "prompt_token_ids": (list, type(None)), "max_new_tokens": (int,), "temperature": _NUM, "top_k": (int,),
    "top_p": _NUM, "seed": (int, type(None)), "stop": (list,), "stop_token_ids": (list,), "ignore_eos": (bool,),
    "tau_min": (int,), "tau_max": (int,), "min_confidence": (*_NUM, type(None)), "profile": (str,),
    "arrival_s": _NUM, "traceparent": (str,), "sent_s": _NUM, "push_to": (str,), "push_token": (str,),
    "presence_penalty": _NUM, "frequency_penalty": _NUM, "repetition_penalty": _NUM, "logit_bias": (list,),
    "grammar": (str,), "logprobs": (int,), "prefill_with": (str,), "field_names": (str,),
}


def check_types(req: ReplicaRequest) -> ReplicaRequest:
    """Every field of the type it is declared with (a replica called past the gateway checks this itself); errors
    name the field in the request's API's names."""
    n = names_of(req)
    for name, kinds in _FIELD_TYPES.items():
        value = getattr(req, name)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise InvalidRequest(n.of(name), f"must be of type {' or '.join(k.__name__ for k in kinds)}, "
                                       f"got {type(value).__name__}")
    items: list[tuple[str, list[Any], type]] = [
        ("stop", req.stop, str), ("stop_token_ids", req.stop_token_ids, int),
        ("prompt_token_ids", req.prompt_token_ids or [], int), ("messages", req.messages or [], dict)]
    for name, values, kind in items:
        for i, v in enumerate(values):
            if not isinstance(v, kind) or isinstance(v, bool):
                raise InvalidRequest(n.of(f"{name}[{i}]"), f"must be of type {kind.__name__}, got {type(v).__name__}")
    for i, pair in enumerate(req.logit_bias):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], int)
                and isinstance(pair[1], _NUM) and not isinstance(pair[0], bool)):
            raise InvalidRequest(n.of(f"logit_bias[{i}]"), "must be a (token id, bias) pair")
    for i, m in enumerate(req.messages or []):
        if set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
            raise InvalidRequest(f"{n.messages}[{i}]", "must be {role: str, content: str}")
    return req


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequest(name, f"must be in [{lo}, {hi}], got {value}")


def _check_text(name: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(name, f"must be valid Unicode (lone surrogate at index {e.start})") from e


def _check_input(req: ReplicaRequest, limits: Limits, n: FieldNames) -> None:
    chars = limits.max_prompt_chars
    if req.prompt is None and not req.messages and not req.prompt_token_ids:
        raise InvalidRequest(n.input, f"one of prompt or {n.messages} is required")
    if req.prompt is not None:
        if len(req.prompt) > chars:
            raise InvalidRequest(n.of("prompt"), f"at most {chars} characters, got {len(req.prompt)}")
        _check_text(n.of("prompt"), req.prompt)
        if not req.prompt.strip():
            raise InvalidRequest(n.of("prompt"), "must not be empty")
    msgs = req.messages or []
    if len(msgs) > limits.max_messages:
        raise InvalidRequest(n.messages, f"at most {limits.max_messages} messages, got {len(msgs)}")
    total = 0
    for i, m in enumerate(msgs):
        if m.get("role") not in ("system", "user", "assistant"):
            raise InvalidRequest(f"{n.messages}[{i}].role", "must be system, user or assistant")
        content = m.get("content")
        if not content or not isinstance(content, str):
            raise InvalidRequest(f"{n.messages}[{i}].content", "must be a non-empty string")
        total += len(content)
        if total > chars:
            raise InvalidRequest(f"{n.messages}[{i}].content", f"all contents together at most {chars} characters")
        _check_text(f"{n.messages}[{i}].content", content)
    ids = req.prompt_token_ids or []
    if len(ids) > chars:
        raise InvalidRequest(n.prompt_token_ids, f"at most {chars} token ids, got {len(ids)}")


def _check_shaping(req: ReplicaRequest, n: FieldNames) -> None:
    _check_range(n.of("presence_penalty"), req.presence_penalty, -2.0, 2.0)
    _check_range(n.of("frequency_penalty"), req.frequency_penalty, -2.0, 2.0)
    _check_range(n.of("repetition_penalty"), req.repetition_penalty, 0.0, 10.0)
    if req.repetition_penalty == 0.0:
        raise InvalidRequest(n.of("repetition_penalty"), "must be > 0")
    if len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(n.of("logit_bias"), f"at most {MAX_LOGIT_BIAS} entries, got {len(req.logit_bias)}")
    for token, bias in req.logit_bias:
        if not 0 <= token < 2**31:
            raise InvalidRequest(n.of("logit_bias"), f"token ids must be >= 0, got {token}")
        _check_range(n.of("logit_bias"), bias, -100.0, 100.0)
    if not -1 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(n.of("top_logprobs"), f"must be in 0..{MAX_TOP_LOGPROBS}, got {req.logprobs}")
    if len(req.grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(n.of("response_format"), f"the grammar is at most {MAX_GRAMMAR_CHARS} characters")


def validate(req: ReplicaRequest, limits: Limits | None = None) -> ReplicaRequest:
    """Check every field; raise :class:`InvalidRequest` naming the first bad one in the names of the request's API
    (``req.field_names``)."""
    n = names_of(req)
    _check_input(req, limits or Limits(), n)
    if not 1 <= req.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise InvalidRequest(n.max_new_tokens, f"must be in 1..{MAX_NEW_TOKENS_LIMIT}, got {req.max_new_tokens}")
    _check_range(n.of("temperature"), req.temperature, 0.0, 10.0)
    _check_range(n.of("top_p"), req.top_p, 0.0, 1.0)
    if req.top_p == 0.0:
        req.top_p = 1.0
    if req.top_k < 0:
        raise InvalidRequest(n.of("top_k"), f"must be >= 0, got {req.top_k}")
    if req.tau_min < 0 or req.tau_max < 0:
        raise InvalidRequest(n.of("tau_min" if req.tau_min < 0 else "tau_max"), "must be >= 0")
    if req.tau_min and req.tau_max and req.tau_min > req.tau_max:
        raise InvalidRequest(n.of("tau_min"), f"must be <= {n.of('tau_max')} ({req.tau_max}), got {req.tau_min}")
    if req.min_confidence is not None:
        _check_range(n.of("min_confidence"), req.min_confidence, 0.0, 1.0)
    if req.profile not in PROFILES.values():
        raise InvalidRequest(n.of("profile"), f"must be one of {', '.join(p for p in PROFILES.values() if p)} "
                                              f"(or empty: the variant's default), got {req.profile!r}")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise InvalidRequest(n.of("seed"), f"must be in 0..{MAX_SEED}, got {req.seed}")
    if len(req.stop) > MAX_STOP:
        raise InvalidRequest(n.of("stop"), f"at most {MAX_STOP} stop strings, got {len(req.stop)}")
    for i, stop in enumerate(req.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(n.of(f"stop[{i}]"), f"must be 1..{MAX_STOP_CHARS} characters, got {len(stop)}")
        _check_text(n.of(f"stop[{i}]"), stop)
    if len(req.stop_token_ids) > MAX_STOP:
        raise InvalidRequest(n.of("stop_token_ids"), f"at most {MAX_STOP} ids, got {len(req.stop_token_ids)}")
    if any(t < 0 for t in req.stop_token_ids):
        raise InvalidRequest(n.of("stop_token_ids"), "must be >= 0")
    _check_shaping(req, n)
    if len(req.request_id) > 128:
        raise InvalidRequest(n.of("request_id"), "at most 128 characters")
    req.request_id = req.request_id or uuid.uuid4().hex
    return req


def from_proto(msg: Any, arrival_s: float, limits: Limits | None = None) -> ReplicaRequest:
    """A validated :class:`ReplicaRequest` from a ``dmtd.v1.GenerateRequest``."""
    which = msg.WhichOneof("input")
    s, c = msg.sampling, msg.cycle
    req = ReplicaRequest(
        request_id=msg.request_id,
        prompt=msg.prompt if which == "prompt" else None,
        messages=[{"role": m.role, "content": m.content} for m in msg.chat.messages] if which == "chat" else None,
        max_new_tokens=msg.max_new_tokens or MAX_NEW_TOKENS_DEFAULT,
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        tau_min=c.tau_min, tau_max=c.tau_max,
        min_confidence=c.min_confidence if c.HasField("min_confidence") else None,
        profile=PROFILES.get(c.profile, ""), arrival_s=arrival_s,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, logit_bias=sorted(s.logit_bias.items()),
        logprobs=msg.logprobs if msg.HasField("logprobs") else -1,
    )
    if msg.json_schema:
        from dmtd.serve.structured import schema_text_grammar

        req.grammar = schema_text_grammar(msg.json_schema)
    if msg.min_block_tokens < 0:
        raise InvalidRequest("min_block_tokens", "must be >= 0")
    if msg.flush_interval_ms < 0:
        raise InvalidRequest("flush_interval_ms", "must be >= 0")
    return validate(req, limits)
