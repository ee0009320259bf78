"""A replica's variants beside its own, over one trunk: loaded onto its engine (on the engine's thread, between two
steps: the streams in flight go on), let go when retired (after their last request) or to make room (least recently
used idle ones), followed from the registry (the desired state: every active variant of the trunk), and the one a
request names resolved to the engine's (``VariantUnavailable``, naming it and why, where it is not served)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmtd.serve.variant_set import ServedVariant, VariantSet
from dmtd_contract.records import ReplicaRequest

if TYPE_CHECKING:  # torch loads in the replica's process only
    from dmtd.engine.llm import LLMEngine
    from dmtd.serve.engine_loop import EngineLoop

log = logging.getLogger("dmtd.replica")


def load_onto(engine: LLMEngine, trunk: Any, source: str, name: str | None = None) -> ServedVariant:
    """On the engine's thread: ``source``'s decoding group built over ``trunk`` and added to ``engine`` (a
    ``ManifestError`` or ``ConfigError`` naming what is wrong with its files, otherwise)."""
    import torch

    from dmtd.engine.config import ConfigError
    from dmtd.variants.paths import SHIPPED_VARIANTS
    from dmtd.variants.tails import load_tails

    got = load_tails(trunk, source, getattr(torch, engine.cfg.dtype), [SHIPPED_VARIANTS])
    m = got.manifest
    if name is not None and m.name != name:
        raise ConfigError(f"variant {name!r}: its manifest {source!r} names {m.name!r}")
    t0 = time.perf_counter()
    nbytes = engine.add_variant(m.name, got.layers)
    return ServedVariant(m.name, source, nbytes, got.load_s + time.perf_counter() - t0, m.default_tau,
                         min(m.tau_max, engine.dmtd.tau_max), m.min_confidence, m.default_profile)


class ReplicaVariants:
    """The variants a replica serves beside its own (``own``) over ``trunk`` (None: only its own)."""

    def __init__(self, own: str, trunk: Any, max_variants: int, replica_name: str) -> None:
        self.set = VariantSet(own, max_variants)
        self.trunk, self.replica_name = trunk, replica_name
        self.loop: EngineLoop | None = None  # set once the replica's engine loop runs
        self.registry: Any = None  # a RegistryClient, where the replica follows one (load reports go there)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- requests -------------------------------------------------------------------------------------------
    def admit(self, req: ReplicaRequest) -> ServedVariant | None:
        """The variant ``req`` names, resolved (``req.variant`` becomes the engine's name for it: "" for the
        replica's own) with its operating point applied where the request sets none; counted in flight."""
        served = self.set.resolve(req.variant)
        if served is None:
            req.variant = ""
            return None
        req.profile = served.profile_of(req.profile)
        req.tau_max = min(req.tau_max or served.tau_max, served.tau_max)
        req.tau_min = min(req.tau_min, req.tau_max)
        if req.min_confidence is None:
            req.min_confidence = served.min_confidence
        self.set.begin(served)
        return served

    def release(self, served: ServedVariant | None) -> None:
        """A request admitted with ``served`` ended; a retiring variant goes after its last one."""
        if served is not None and self.set.end(served):
            self._spawn(self.unload(served.name))

    # -- loading --------------------------------------------------------------------------------------------
    def load_now(self, executor: ThreadPoolExecutor, engine: LLMEngine, source: str, name: str | None = None) -> None:
        """Load ``source`` before the replica serves (its construction: nothing runs on the engine thread yet);
        a refusal is recorded, not raised: the replica serves the others."""
        if self.trunk is None:
            self._refused(name or source, "this replica's model has no files to build other variants' tails from")
            return
        evict = self.set.to_evict()
        for victim in evict or []:
            executor.submit(engine.remove_variant, victim).result()
            self.set.served.pop(victim, None)
        if evict is None:
            self._refused(name or source, f"max_variants ({self.set.max_variants}) are loaded and busy")
            return
        try:
            served = executor.submit(load_onto, engine, self.trunk, source, name).result()
        except Exception as e:  # a ManifestError / ConfigError names the file and rule; anything else too
            self._refused(name or source, str(e))
            return
        self._loaded(served)

    async def load(self, source: str, name: str | None = None) -> None:
        """Load ``source`` while serving: its tails are built and added on the engine's thread between two steps."""
        key = name or source
        if self.trunk is None or self.loop is None or key in self.set.loading or key in self.set.served:
            return
        self.set.loading.add(key)
        try:
            evict = self.set.to_evict()
            if evict is None:
                self._refused(key, f"max_variants ({self.set.max_variants}) are loaded and busy")
                return
            for victim in evict:
                await self.unload(victim)
            trunk = self.trunk
            served = await self.loop.call(lambda e: load_onto(e, trunk, source, name))
        except Exception as e:
            self._refused(key, str(e))
        else:
            self._loaded(served)
        finally:
            self.set.loading.discard(key)

    async def unload(self, name: str) -> None:
        """Let ``name`` go now if idle, else once its last request ends (it takes no new ones meanwhile)."""
        served = self.set.served.get(name)
        if served is None or self.loop is None:
            return
        served.retiring = True
        if served.inflight:
            return
        del self.set.served[name]
        await self.loop.call(lambda e: e.remove_variant(name))
        log.info("replica %s: variant %s let go", self.replica_name, name)

    def _loaded(self, served: ServedVariant) -> None:
        served.last_used_s = self.set.clock()
        self.set.served[served.name] = served
        self.set.failed.pop(served.name, None)
        log.info("replica %s: variant %s loaded in %.2f s (%.1f MB)", self.replica_name, served.name, served.load_s,
                 served.nbytes / 1e6)
        self._report(served.name, None)

    def _refused(self, name: str, why: str) -> None:
        self.set.failed[name] = why
        log.error("replica %s: variant %s refused: %s", self.replica_name, name, why)
        self._report(name, why)

    def _report(self, name: str, error: str | None) -> None:
        if self.registry is not None:
            try:
                self.registry.report_load(name, self.replica_name, error)
            except Exception:
                log.warning("replica %s: could not report variant %s's load to the registry", self.replica_name, name)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    # -- the registry: the desired state ---------------------------------------------------------------------
    def desired(self, snapshot: Any) -> dict[str, str]:
        """The active variants of the registry ``snapshot`` this replica's trunk runs (name → manifest), beside its
        own; entries of other bases or splits belong to other replicas and are not named."""
        if self.trunk is None:
            return {}
        from dmtd.variants.loader import resolve_model_path

        d, out = self.trunk.dmtd, {}
        for entry in snapshot.list("active"):
            if entry.name == self.set.own or not entry.manifest_uri:
                continue
            split = (entry.num_encoding_layers, entry.num_thinking_layers, entry.num_decoding_layers,
                     entry.phase_anchor, entry.head_input)
            if split != (d.num_encoding_layers, d.num_thinking_layers, d.num_decoding_layers, d.phase_anchor,
                         d.head_input):
                continue
            try:
                if Path(resolve_model_path(entry.base_model)).resolve() != Path(self.trunk.path).resolve():
                    continue
            except Exception:
                continue
            out[entry.name] = entry.manifest_uri
        return out

    def follow(self, snapshot: Any, registered: set[str]) -> None:
        """Bring the loaded set to the registry's desired one: load what is new, let go what was retired (after its
        last request). ``registered``: the names loaded because the registry named them (others came from the
        replica's own arguments and stay)."""
        want = self.desired(snapshot)
        for name, source in want.items():
            registered.add(name)
            served = self.set.served.get(name)
            if served is None:
                self._spawn(self.load(source, name))
            else:  # retired and active again before its last request ended: it stays
                served.retiring = False
        for name in sorted(registered - set(want)):
            registered.discard(name)
            self._spawn(self.unload(name))
