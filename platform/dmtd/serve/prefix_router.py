"""Prefix-aware routing across a variant's replicas, on Serve's request-router API (what Ray Serve LLM's
``PrefixCacheAffinityRouter`` does, without its detached tree actor: the gateway owns the only handle).

Each replica keeps the prompts it served in its prefix cache (:mod:`dmtd.engine.prefix_cache`). The router keeps
an approximate index of what it sent where: a hash chain over ``CHUNK_CHARS``-character runs of the prompt text
(the gateway does not tokenise), each key → the replicas it went to and when. A request goes to the replica
holding its longest indexed prefix unless that replica has ``imbalance`` more requests in flight than the least
loaded one (then the least loaded: load first); a prompt with no indexed prefix goes to the least loaded
replica, ties to the one holding the fewest prefixes, so distinct system prompts spread over the replicas.
A replica's load is the requests this router sent it that have not completed (:class:`InFlight`, counted from the
moment of the choice), or Serve's cached queue length for it where that is higher: the cache alone lags a burst
(it counts a request once it is sent, and forgets a replica's entry after a while), and a burst of 12 new
requests once all went to one replica.
Replicas that leave (scaled down, died) are dropped from the index. Each decision, by reason, goes to the gateway
the router runs in (:func:`gateway_sink`: ``GatewayIngress.on_route_decision``, its metrics).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

CHUNK_CHARS = 256  # about 64 SmolLM2 tokens: the index's grain
MAX_KEYS = 200_000  # keys kept (least recently used dropped): ~50 M characters of prompts
REASONS = ("prefix", "new_prefix", "load")


class DecisionSink(Protocol):
    """What a router reports its decisions to: the gateway whose handles it routes for (``GatewayIngress``)."""

    def on_route_decision(self, deployment: str, reason: str) -> None: ...


def gateway_sink() -> DecisionSink | None:
    """The Serve replica this router runs in, when it takes decisions (Serve builds a handle's router inside the
    process that holds the handle: the gateway); None outside a replica or before its object is built."""
    try:
        from ray import serve

        obj: Any = serve.get_replica_context().servable_object
    except Exception:  # not inside a Serve replica (a router built by a test)
        return None
    return obj if callable(getattr(obj, "on_route_decision", None)) else None


def prompt_text(req: Any) -> str:
    """The text a replica's prompt starts with: chat messages as role and content, else the prompt, else ids; ""
    for anything else. Never raises: a malformed request is the replica's to refuse (naming the field), and an
    exception here would leave it unrouted."""
    try:
        if getattr(req, "messages", None):
            return "".join(f"<{m.get('role', '')}>{m.get('content', '')}\n" if isinstance(m, dict) else f"<>{m}\n"
                           for m in req.messages)
        if getattr(req, "prompt", None):
            return str(req.prompt)
        return ",".join(map(str, getattr(req, "prompt_token_ids", None) or []))
    except Exception:
        return ""


def text_keys(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """Keys of the text's whole ``chunk``-character runs, each covering every character before its end."""
    keys, prev = [], b""
    for i in range(len(text) // chunk):
        prev = hashlib.blake2b(prev + text[i * chunk: (i + 1) * chunk].encode(), digest_size=12).digest()
        keys.append(prev)
    return keys


class PrefixIndex:
    """Key → the replicas (ids as strings) that were sent a prompt with that prefix, least recently used first."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.keys: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self.roots: dict[str, set[bytes]] = {}  # replica → the first keys of its prompts (its prefixes)

    def longest(self, keys: list[bytes], among: set[str]) -> tuple[int, set[str]]:
        """The most leading keys some of ``among`` hold, and which of them hold that many."""
        for i in range(len(keys) - 1, -1, -1):
            holders = self.keys.get(keys[i])
            if holders and (hit := among & holders.keys()):
                return i + 1, hit
        return 0, set()

    def insert(self, keys: list[bytes], replica: str) -> None:
        now = time.monotonic()
        for k in keys:
            self.keys.setdefault(k, {})[replica] = now
            self.keys.move_to_end(k)
        if keys:
            self.roots.setdefault(replica, set()).add(keys[0])
        while len(self.keys) > self.max_keys:
            k, holders = self.keys.popitem(last=False)
            for r in holders:
                self.roots.get(r, set()).discard(k)

    def drop(self, replica: str) -> None:
        for holders in self.keys.values():
            holders.pop(replica, None)
        self.roots.pop(replica, None)

    def num_prefixes(self, replica: str) -> int:
        return len(self.roots.get(replica, ()))


class InFlight:
    """Requests routed to each replica and not completed yet, by Serve's request id (a request routed again is
    counted where it went last); entries older than ``ttl_s`` (a request cancelled before it was sent, whose
    completion never comes) are forgotten."""

    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self.where: dict[str, tuple[str, float]] = {}  # request id → (replica, when routed)

    def assign(self, request_id: str, replica: str) -> None:
        self.where[request_id] = (replica, self.clock())

    def complete(self, request_id: str) -> None:
        self.where.pop(request_id, None)

    def drop(self, replica: str) -> None:
        self.where = {k: v for k, v in self.where.items() if v[0] != replica}

    def counts(self) -> Counter[str]:
        old = self.clock() - self.ttl_s
        if any(t < old for _, t in self.where.values()):
            self.where = {k: v for k, v in self.where.items() if v[1] >= old}
        return Counter(r for r, _ in self.where.values())


class PrefixRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the DMTD replicas: the replica most likely to hold the prompt's prefix,
    with a load fallback (``request_router_kwargs``: ``imbalance``, ``chunk_chars``). Requests are routed in
    arrival order (``FIFOMixin``, as Serve's own router): without it, concurrent requests could be left waiting
    on routing tasks that had taken others (n copies of one prompt hung)."""

    def initialize_state(self, imbalance: int = 4, chunk_chars: int = CHUNK_CHARS, **_: Any) -> None:
        self.imbalance, self.chunk_chars = imbalance, chunk_chars
        self.index = PrefixIndex()
        self.inflight = InFlight()
        self.name = self._deployment_id.name if getattr(self, "_deployment_id", None) else ""
        self.sink: DecisionSink | None = None

    def _report(self, reason: str) -> None:
        if self.sink is None:  # looked up until the gateway's object exists, then kept
            self.sink = gateway_sink()
        if self.sink is not None:
            self.sink.on_route_decision(self.name, reason)

    def _load(self, r: RunningReplica, own: Counter[str]) -> int:
        n = self.replica_queue_len_cache.get(r.replica_id)
        return max(own[r.replica_id.to_full_id_str()], 0 if n is None else int(n))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:  # routing must never strand a request: every candidate, in Serve's order
            return [list(candidate_replicas)]

    def _choose(self, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        own = self.inflight.counts()
        load = {r.replica_id.to_full_id_str(): self._load(r, own) for r in candidate_replicas}
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        least = min(load.values())
        keys: list[bytes] = []
        if pending_request is not None and pending_request.args:
            keys = text_keys(prompt_text(pending_request.args[0]), self.chunk_chars)
        if not keys:  # nothing to match (a short or malformed prompt): the least loaded replica, not indexed
            ranked = sorted(by_id, key=lambda r: (load[r], r))
            self._assign(pending_request, ranked[0])
            return [[by_id[r] for r in ranked]]
        matched, holders = self.index.longest(keys, set(by_id))
        if matched:
            best = min(holders, key=lambda r: (load[r], r))
            reason = "prefix" if load[best] - least <= self.imbalance else "load"
        else:
            best, reason = "", "new_prefix"
        if reason != "prefix":
            best = min(by_id, key=lambda r: (load[r], self.index.num_prefixes(r), r))
        self._report(reason)
        self.index.insert(keys, best)
        self._assign(pending_request, best)
        rest = sorted((r for r in by_id if r != best), key=lambda r: (load[r], r))
        return [[by_id[best]], [by_id[r] for r in rest]] if rest else [[by_id[best]]]

    def _assign(self, pending_request: PendingRequest | None, replica: str) -> None:
        if pending_request is not None:
            self.inflight.assign(pending_request.metadata.internal_request_id, replica)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.inflight.complete(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.to_full_id_str() for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.replica_id.to_full_id_str() for r in replicas}:
            self.index.drop(gone)
            self.inflight.drop(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id.to_full_id_str())
        self.inflight.drop(replica_id.to_full_id_str())
