"""Request validation and conversion between the wire format (protobuf), the replica's dicts and the engine.

Validation happens at the gateway, before a request takes a queue slot; every error names the field and
the rule (it becomes gRPC ``INVALID_ARGUMENT`` / HTTP 400).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

PROFILES = {0: "adaptive", 1: "quality", 2: "balanced", 3: "speed"}
MAX_NEW_TOKENS_LIMIT = 4096


class InvalidRequest(ValueError):
    """A request field breaks a rule."""

    def __init__(self, field_name: str, rule: str) -> None:
        super().__init__(f"{field_name}: {rule}")
        self.field, self.rule = field_name, rule

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (InvalidRequest, (self.field, self.rule))


@dataclass(slots=True)
class ReplicaRequest:
    """What a replica needs to run one request (plain data: crosses Ray by pickling)."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tau_min: int = 0
    tau_max: int = 0
    min_confidence: float | None = None
    profile: str = "adaptive"
    arrival_s: float = 0.0
    traceparent: str = ""  # W3C trace context of the gateway span: the replica span becomes its child

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequest(name, f"must be in [{lo}, {hi}], got {value}")


def validate(req: ReplicaRequest) -> ReplicaRequest:
    """Check every field; raise :class:`InvalidRequest` naming the first bad one."""
    if req.prompt is None and not req.messages and not req.prompt_token_ids:
        raise InvalidRequest("input", "one of prompt or chat.messages is required")
    if req.prompt is not None and not req.prompt.strip():
        raise InvalidRequest("prompt", "must not be empty")
    for i, m in enumerate(req.messages or []):
        if m.get("role") not in ("system", "user", "assistant"):
            raise InvalidRequest(f"chat.messages[{i}].role", "must be system, user or assistant")
        if not m.get("content"):
            raise InvalidRequest(f"chat.messages[{i}].content", "must not be empty")
    if not 1 <= req.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise InvalidRequest("max_new_tokens", f"must be in 1..{MAX_NEW_TOKENS_LIMIT}, got {req.max_new_tokens}")
    _check_range("sampling.temperature", req.temperature, 0.0, 10.0)
    _check_range("sampling.top_p", req.top_p, 0.0, 1.0)
    if req.top_p == 0.0:
        req.top_p = 1.0
    if req.top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0, got {req.top_k}")
    if req.tau_min < 0 or req.tau_max < 0:
        raise InvalidRequest("cycle.tau_min" if req.tau_min < 0 else "cycle.tau_max", "must be >= 0")
    if req.tau_min and req.tau_max and req.tau_min > req.tau_max:
        raise InvalidRequest("cycle.tau_min", f"must be <= cycle.tau_max ({req.tau_max}), got {req.tau_min}")
    if req.min_confidence is not None:
        _check_range("cycle.min_confidence", req.min_confidence, 0.0, 1.0)
    if any(not s for s in req.stop):
        raise InvalidRequest("stop", "stop strings must be non-empty")
    if any(t < 0 for t in req.stop_token_ids):
        raise InvalidRequest("stop_token_ids", "must be >= 0")
    if len(req.request_id) > 128:
        raise InvalidRequest("request_id", "at most 128 characters")
    req.request_id = req.request_id or uuid.uuid4().hex
    return req


def from_proto(msg: Any, arrival_s: float) -> ReplicaRequest:
    """A validated :class:`ReplicaRequest` from a ``dmtd.v1.GenerateRequest``."""
    which = msg.WhichOneof("input")
    s, c = msg.sampling, msg.cycle
    req = ReplicaRequest(
        request_id=msg.request_id,
        prompt=msg.prompt if which == "prompt" else None,
        messages=[{"role": m.role, "content": m.content} for m in msg.chat.messages] if which == "chat" else None,
        max_new_tokens=msg.max_new_tokens or 128,
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        tau_min=c.tau_min, tau_max=c.tau_max,
        min_confidence=c.min_confidence if c.HasField("min_confidence") else None,
        profile=PROFILES.get(c.profile, "adaptive"), arrival_s=arrival_s,
    )
    if msg.min_block_tokens < 0:
        raise InvalidRequest("min_block_tokens", "must be >= 0")
    if msg.flush_interval_ms < 0:
        raise InvalidRequest("flush_interval_ms", "must be >= 0")
    return validate(req)
