"""Typed request failures raised inside a replica; they cross Ray by pickling and the gateway maps them to
status codes (gRPC status, HTTP status) in one place (``GatewayCore._map_error``). ``InvalidRequest`` and ``TooLarge``
are raised at the edge, by request validation (``dmtd.serve.requests``, ``dmtd.serve.structured``)."""

from __future__ import annotations

import uuid


class Overloaded(RuntimeError):
    """The replica's queue is full; retry after ``retry_after_ms``."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"replica queue is full; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[type, tuple[int]]:  # crosses Ray: rebuild from our own arguments
        return (Overloaded, (self.retry_after_ms,))


class RequestFailed(RuntimeError):
    """A request was rejected by the replica because of its input (e.g. prompt length, untokenisable text)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (RequestFailed, (self.field, str(self)))


class VariantUnavailable(RuntimeError):
    """The request names a variant this replica does not serve: unknown, still loading, its files refused, or retired
    (gRPC NOT_FOUND, HTTP 404); the message names it and why."""

    def __init__(self, variant: str, message: str) -> None:
        super().__init__(message)
        self.variant = variant

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (VariantUnavailable, (self.variant, str(self)))


class ReplicaInternalError(RuntimeError):
    """A request failed for a reason that is not its input's fault; ``error_id`` is in the replica's log."""

    def __init__(self, message: str, error_id: str | None = None) -> None:
        self.error_id = error_id or uuid.uuid4().hex[:16]
        super().__init__(f"{message} (error id {self.error_id})")
        self.detail = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (ReplicaInternalError, (self.detail, self.error_id))


class InvalidRequest(ValueError):
    """A request field breaks a rule."""

    def __init__(self, field_name: str, rule: str) -> None:
        super().__init__(f"{field_name}: {rule}")
        self.field, self.rule = field_name, rule

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.field, self.rule))


class TooLarge(InvalidRequest):
    """The request as a whole exceeds a size limit (HTTP 413; gRPC INVALID_ARGUMENT)."""
