"""The registry client: reads and all-or-nothing, lost-update-free writes of variant entries in Redis.

Every write follows one pattern (optimistic locking): WATCH the global revision and the keys it touches,
read the current state, compute and validate the new entry in Python, then MULTI / EXEC the entry, its
indexes, the default pointer, the revision INCR and the PUBLISH of the change notice. If any other writer
committed in between (every write INCRs the revision), EXEC aborts and the write is retried from a fresh
read, so no update is lost; a failure before EXEC discards the queued commands, so nothing is half-written.
Key types are checked while watched, so EXEC itself cannot fail half-way on a WRONGTYPE error.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import redis
from pydantic import ValidationError
from redis.client import Pipeline

from dmtd_contract.registry.entry import VariantEntry, VariantSpec, validated
from dmtd_contract.registry.errors import (
    InvalidTransition,
    InvalidVariant,
    RegistryConflict,
    RegistryCorrupt,
    RegistryUnavailable,
    VariantExists,
    VariantNotFound,
)
from dmtd_contract.registry.keys import RegistryKeys
from dmtd_contract.registry.routing import RegistrySnapshot
from dmtd_contract.variant_schema import VariantStatus

#: Fields ``RegistryClient.update`` may change on a registered entry (the rest define what the variant is).
TUNABLE_FIELDS = ("tau_min", "tau_max", "default_tau", "min_confidence", "default_profile", "description")
_KEY_TYPES = {"string", "none"}
_SET_TYPES = {"set", "none"}


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a write turns the state into: the new entry and the new default pointer."""

    entry: VariantEntry
    default_name: str | None
    change: str


Planner = Callable[[VariantEntry | None, str | None], _Plan | None]


class RegistryClient:
    """Synchronous client of one registry (a Redis URL and a namespace). Thread-safe: share one per process.

    ``url``: ``redis://host:port/db``, ``rediss://…`` or ``unix:///path.sock?db=0``. ``clock`` gives the
    timestamps (Unix seconds); ``max_retries`` bounds the optimistic-locking retries of one write.
    """

    def __init__(self, url: str, *, namespace: str = "dmtd", clock: Callable[[], float] = time.time,
                 max_retries: int = 200, socket_timeout_s: float = 5.0) -> None:
        self.url = url
        self.keys = RegistryKeys(namespace)
        self._clock = clock
        self._max_retries = max_retries
        self._jitter = random.Random()
        try:
            self._redis: redis.Redis = redis.Redis.from_url(
                url, decode_responses=True, socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s)
        except ValueError as e:
            raise RegistryUnavailable(f"bad registry URL {url!r}: {e}") from e

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reads -------------------------------------------------------------------------------------------

    def ping(self) -> None:
        """Raise ``RegistryUnavailable`` unless Redis answers."""
        with self._errors():
            self._redis.ping()

    def revision(self) -> int:
        """The global revision: 0 for an empty registry, +1 per change."""
        with self._errors():
            return _as_int(self._redis.get(self.keys.revision), self.keys.revision)

    def get(self, name: str) -> VariantEntry:
        """The entry of that name, whatever its status."""
        with self._errors():
            raw = cast(str | None, self._redis.get(self.keys.entry(name)))
        if raw is None:
            raise VariantNotFound(name)
        return self._parse(name, raw)

    def list(self, status: VariantStatus | None = None) -> list[VariantEntry]:
        """Entries sorted by name, optionally only those in ``status`` (read through the status index)."""
        index = self.keys.names if status is None else self.keys.status(status)
        with self._errors():
            names = sorted(cast(set[str], self._redis.smembers(index)))
            raws = cast(list[str | None], self._redis.mget([self.keys.entry(n) for n in names])) if names else []
        entries = [self._parse(n, raw) for n, raw in zip(names, raws) if raw is not None]
        return [e for e in entries if status is None or e.status == status]  # a write may land between reads

    def default_name(self) -> str | None:
        """The name of the default variant, or None."""
        with self._errors():
            return cast(str | None, self._redis.get(self.keys.default))

    def default(self) -> VariantEntry:
        """The default variant (``VariantNotFound`` when none is set)."""
        name = self.default_name()
        if name is None:
            raise VariantNotFound(None, "the registry has no default variant")
        return self.get(name)

    def report_load(self, name: str, replica: str, error: str | None) -> None:
        """What a replica made of a variant it was to serve: loaded (``error`` None), or why its files were refused
        (what ``dmtd variants show`` prints beside the entry). Not a change of the entry: no revision, no notice."""
        with self._errors():
            self._redis.hset(self.keys.loads(name), replica, error or "")

    def load_reports(self, name: str) -> dict[str, str]:
        """Each replica's report of its load of ``name``: "" served, else why it was refused."""
        with self._errors():
            return dict(cast(dict[str, str], self._redis.hgetall(self.keys.loads(name))))

    def snapshot(self) -> RegistrySnapshot:
        """Every entry, the default and the revision, read consistently (retried if a write lands meanwhile)."""
        k = self.keys
        for attempt in range(self._max_retries):
            with self._errors(), self._redis.pipeline() as pipe:
                try:
                    _watch(pipe, k.revision)
                    rev = _as_int(pipe.get(k.revision), k.revision)
                    names = sorted(cast(set[str], pipe.smembers(k.names)))
                    raws = cast(list[str | None], pipe.mget([k.entry(n) for n in names])) if names else []
                    default = cast(str | None, pipe.get(k.default))
                    pipe.multi()
                    pipe.get(k.revision)
                    pipe.execute()
                except redis.WatchError:
                    self._backoff(attempt)
                    continue
            entries = {n: self._parse(n, raw) for n, raw in zip(names, raws) if raw is not None}
            return RegistrySnapshot(rev, entries, default)
        raise RegistryConflict(f"no consistent snapshot after {self._max_retries} tries: writers too busy")

    # ---- writes ------------------------------------------------------------------------------------------

    def register(self, spec: VariantSpec, *, status: VariantStatus = "staged", traffic_weight: float = 0.0,
                 make_default: bool = False) -> VariantEntry:
        """Add a new entry (``VariantExists`` if the name is taken, in any status). All or nothing."""
        if status == "retired":
            raise InvalidVariant("status", "a new variant must be 'staged' or 'active', not 'retired'")
        entry = validated(VariantEntry, {**spec.model_dump(), "status": status, "traffic_weight": traffic_weight})
        if make_default and status != "active":
            raise InvalidTransition(spec.name, "only an active variant can be the default")

        def plan(current: VariantEntry | None, default: str | None) -> _Plan:
            if current is not None:
                raise VariantExists(spec.name)
            takes_default = status == "active" and (make_default or default is None)
            return _Plan(entry, spec.name if takes_default else default, "registered")

        return self._write(spec.name, plan)

    def promote(self, name: str, *, make_default: bool = False) -> VariantEntry:
        """Staged (or retired) → active. The first active variant, or ``make_default``, becomes the default.

        Promoting an active variant only changes the default (when asked); otherwise it is a no-op.
        """

        def plan(current: VariantEntry | None, default: str | None) -> _Plan | None:
            e = _exists(name, current)
            new_default = name if make_default or default is None else default
            if e.status == "active" and new_default == default:
                return None
            change = "promoted" if e.status != "active" else "default"
            return _Plan(_with(e, status="active"), new_default, change)

        return self._write(name, plan)

    def retire(self, name: str) -> VariantEntry:
        """Any status → retired (no traffic). Retiring the default clears the default. Idempotent."""

        def plan(current: VariantEntry | None, default: str | None) -> _Plan | None:
            e = _exists(name, current)
            if e.status == "retired":
                return None
            return _Plan(_with(e, status="retired"), None if default == name else default, "retired")

        return self._write(name, plan)

    def set_default(self, name: str) -> VariantEntry:
        """Make an active variant the default."""

        def plan(current: VariantEntry | None, default: str | None) -> _Plan | None:
            e = _exists(name, current)
            if e.status != "active":
                raise InvalidTransition(name, f"only an active variant can be the default (it is {e.status})")
            return None if default == name else _Plan(e, name, "default")

        return self._write(name, plan)

    def set_weight(self, name: str, traffic_weight: float) -> VariantEntry:
        """Set the traffic weight (0..1, relative among active variants); allowed in any status."""
        return self.update(name, traffic_weight=traffic_weight)

    def update(self, name: str, **fields: Any) -> VariantEntry:
        """Change tunable fields (``TUNABLE_FIELDS`` and ``traffic_weight``); the whole entry is re-validated."""
        allowed = (*TUNABLE_FIELDS, "traffic_weight")
        for f in fields:
            if f not in allowed:
                raise InvalidVariant(f, f"cannot be changed after registration (changeable: {', '.join(allowed)})")
        change = "weight" if set(fields) == {"traffic_weight"} else "updated"

        def plan(current: VariantEntry | None, default: str | None) -> _Plan | None:
            e = _exists(name, current)
            new = _with(e, **fields)
            return None if new == e else _Plan(new, default, change)

        return self._write(name, plan)

    # ---- the transaction ---------------------------------------------------------------------------------

    def _write(self, name: str, plan: Planner) -> VariantEntry:
        k = self.keys
        watched = [k.revision, k.entry(name), k.default, k.names, *k.status_sets()]
        for attempt in range(self._max_retries):
            with self._errors(), self._redis.pipeline() as pipe:
                try:
                    _watch(pipe, *watched)
                    current, default, revision = self._read_for_write(name)
                    p = plan(current, default)
                    if p is None:
                        assert current is not None
                        return current
                    now = self._clock()
                    entry = _with(p.entry, revision=1 if current is None else current.revision + 1,
                                  registry_revision=revision + 1, updated_at_s=now,
                                  created_at_s=now if current is None else current.created_at_s)
                    pipe.multi()
                    self._queue_entry(pipe, entry)
                    self._queue_indexes(pipe, current, entry)
                    self._queue_default(pipe, default, p.default_name)
                    self._queue_notice(pipe, entry, p.change)
                    pipe.execute()
                    return entry
                except redis.WatchError:
                    self._backoff(attempt)
        raise RegistryConflict(f"variant {name!r}: gave up after {self._max_retries} conflicting writes")

    def _queue_entry(self, pipe: Pipeline, entry: VariantEntry) -> None:
        pipe.set(self.keys.entry(entry.name), entry.model_dump_json())

    def _queue_indexes(self, pipe: Pipeline, current: VariantEntry | None, entry: VariantEntry) -> None:
        pipe.sadd(self.keys.names, entry.name)
        if current is not None and current.status != entry.status:
            pipe.srem(self.keys.status(current.status), entry.name)
        pipe.sadd(self.keys.status(entry.status), entry.name)

    def _queue_default(self, pipe: Pipeline, old: str | None, new: str | None) -> None:
        if new == old:
            return
        if new is None:
            pipe.delete(self.keys.default)
        else:
            pipe.set(self.keys.default, new)

    def _queue_notice(self, pipe: Pipeline, entry: VariantEntry, change: str) -> None:
        pipe.incr(self.keys.revision)
        notice = {"name": entry.name, "revision": entry.registry_revision, "change": change}
        pipe.publish(self.keys.channel, json.dumps(notice))

    def _read_for_write(self, name: str) -> tuple[VariantEntry | None, str | None, int]:
        """The entry, default and revision, in one round trip; also checks every written key's type.

        Called after WATCH, so any write that lands after these reads aborts the EXEC that follows.
        """
        k = self.keys
        expected = {k.revision: _KEY_TYPES, k.entry(name): _KEY_TYPES, k.default: _KEY_TYPES,
                    k.names: _SET_TYPES, **{s: _SET_TYPES for s in k.status_sets()}}
        batch = self._redis.pipeline(transaction=False)
        for key in expected:
            batch.type(key)
        for key in (k.entry(name), k.default, k.revision):
            batch.get(key)
        *kinds, raw, default, revision = batch.execute()
        for (key, types), kind in zip(expected.items(), kinds):
            if kind not in types:
                raise RegistryCorrupt(f"registry key {key!r} is a {kind}, expected {' or '.join(sorted(types))}")
        current = None if raw is None else self._parse(name, raw)
        return current, default, _as_int(revision, k.revision)

    def _parse(self, name: str, raw: str) -> VariantEntry:
        try:
            return VariantEntry.model_validate_json(raw)
        except ValidationError as e:
            raise RegistryCorrupt(f"registry entry {self.keys.entry(name)!r} is not a valid entry: {e}") from e

    def _backoff(self, attempt: int) -> None:
        time.sleep(self._jitter.uniform(0, min(0.0005 * 2 ** min(attempt, 8), 0.02)))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise RegistryUnavailable(f"registry at {self.url} unavailable: {e}") from e
        except redis.ResponseError as e:
            raise RegistryUnavailable(f"registry at {self.url} refused: {e}") from e


def _exists(name: str, current: VariantEntry | None) -> VariantEntry:
    if current is None:
        raise VariantNotFound(name)
    return current


def _watch(pipe: Pipeline, *keys: str) -> None:
    cast(Any, pipe).watch(*keys)  # redis-py leaves Pipeline.watch untyped


def _with(entry: VariantEntry, **changes: Any) -> VariantEntry:
    return validated(VariantEntry, {**entry.model_dump(), **changes})


def _as_int(raw: Any, key: str) -> int:
    try:
        return int(raw or 0)
    except (TypeError, ValueError) as e:
        raise RegistryCorrupt(f"registry key {key!r} holds {raw!r}, not an integer") from e

