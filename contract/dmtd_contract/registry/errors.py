"""Typed registry errors. The gateway maps them to gRPC codes; the CLI to exit codes.

=========================  ===================  ========
error                      gRPC                 CLI exit
=========================  ===================  ========
``VariantNotFound``        NOT_FOUND            2
``VariantNotActive``       NOT_FOUND            2
``VariantExists``          ALREADY_EXISTS       2
``InvalidVariant``         INVALID_ARGUMENT     2
``InvalidTransition``      FAILED_PRECONDITION  2
``RegistryUnavailable``    UNAVAILABLE          1
``RegistryConflict``       ABORTED              1
=========================  ===================  ========
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry error; the message is meant for the user."""


class VariantNotFound(RegistryError, LookupError):
    """No entry of that name (or, for routing, no variant that can take the request)."""

    def __init__(self, name: str | None, detail: str | None = None) -> None:
        self.name = name
        super().__init__(detail or f"variant {name!r} not found in the registry")


class VariantNotActive(VariantNotFound):
    """The entry exists but is not active, so it takes no traffic."""

    def __init__(self, name: str, status: str) -> None:
        self.status = status
        super().__init__(name, f"variant {name!r} is {status}, not active")


class VariantExists(RegistryError):
    """``register`` of a name that is already in the registry (whatever its status)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"variant {name!r} already exists in the registry")


class InvalidVariant(RegistryError, ValueError):
    """A field breaks a rule. ``field`` is the field's name, ``rule`` says what it must be."""

    def __init__(self, field: str, rule: str) -> None:
        self.field = field
        self.rule = rule
        super().__init__(f"invalid variant: {field}: {rule}")


class InvalidTransition(RegistryError):
    """A status change the lifecycle does not allow (e.g. promoting a variant to default while staged)."""

    def __init__(self, name: str, rule: str) -> None:
        self.name = name
        self.rule = rule
        super().__init__(f"variant {name!r}: {rule}")


class RegistryUnavailable(RegistryError, ConnectionError):
    """Redis cannot be reached, timed out, or holds keys of the wrong type."""


class RegistryConflict(RegistryError):
    """Optimistic locking gave up after too many concurrent writers won the race."""


class RegistryCorrupt(RegistryUnavailable):
    """A registry key holds something the registry did not write (wrong type or unparsable value)."""
