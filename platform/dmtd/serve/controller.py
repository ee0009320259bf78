"""The per-replica adaptive τ / min_confidence controller (pure: no Ray, no torch).

A DMTD replica has an instant capacity knob: a longer cycle (τ) decodes more tokens per weight read. The
controller rests at the variant's operating point (``default_tau``, ``min_confidence``), raises τ and
loosens the confidence gate under pressure (queued requests, a full batch, per-token ITL near the SLO),
and returns to the operating point when there is headroom. It does not raise τ when the gate already
cuts most cycles short (a longer cycle would not emit longer blocks).

Requests of the exact profile follow the same decisions: for them τ and the gate set only how much is drafted
(at most τ − 1 drafts a cycle, drafting stops at a draft below the gate), never the tokens, which stay the
verifier's. A request that names no profile gets the variant's (``default_profile``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dmtd_contract.stats import percentile


@dataclass(slots=True)
class ControllerConfig:
    tau_min: int = 1
    tau_max: int = 4
    rest_tau: int = 3
    rest_min_confidence: float = 0.0
    pressure_min_confidence: float = 0.0
    itl_slo_ms: float = 50.0
    max_batch: int = 16
    window: int = 256  # per-token ITL samples kept
    hold_steps: int = 8  # decisions at least this many observations apart
    default_profile: str = "dmtd"  # the variant's: a request naming no profile gets "adaptive" or "exact"

    def clamp(self, tau: int) -> int:
        return max(self.tau_min, min(self.tau_max, tau))

    def profile_of(self, requested: str) -> str:
        """The profile a request runs with: its own, else the variant's default ("dmtd" is the adaptive one)."""
        return requested or ("exact" if self.default_profile == "exact" else "adaptive")


@dataclass(slots=True)
class Decision:
    tau: int
    min_confidence: float
    reason: str


@dataclass
class TauController:
    """Feed it observations; read ``decision``. Deterministic given the observations."""

    cfg: ControllerConfig
    itl_ms: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    block_ratio: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    queue_depth: int = 0
    batch_size: int = 0
    since_change: int = 0
    decision: Decision = field(init=False)

    def __post_init__(self) -> None:
        self.itl_ms = deque(maxlen=self.cfg.window)
        self.decision = Decision(self.cfg.clamp(self.cfg.rest_tau), self.cfg.rest_min_confidence, "operating point")

    def reconfigure(self, cfg: ControllerConfig) -> Decision:
        self.cfg = cfg
        self.itl_ms = deque(self.itl_ms, maxlen=cfg.window)
        tau = cfg.clamp(self.decision.tau)
        self.decision = Decision(tau, self.decision.min_confidence, f"bounds changed to {cfg.tau_min}..{cfg.tau_max}")
        return self.decision

    def observe_block(self, k: int, tau: int, interval_ms: float) -> None:
        """A block of ``k`` tokens arrived ``interval_ms`` after the previous one of its request."""
        if k > 0:
            self.itl_ms.extend([interval_ms / k] * k)
            self.block_ratio.append(k / max(tau, 1))

    def observe_load(self, queue_depth: int, batch_size: int) -> Decision:
        self.queue_depth, self.batch_size = queue_depth, batch_size
        self.since_change += 1
        if self.since_change >= self.cfg.hold_steps:
            new = self._decide()
            if (new.tau, new.min_confidence) != (self.decision.tau, self.decision.min_confidence):
                self.since_change = 0
            self.decision = new
        return self.decision

    def itl_p95_ms(self) -> float:
        return percentile(self.itl_ms, 0.95)

    def _decide(self) -> Decision:
        c, cur = self.cfg, self.decision
        p95 = self.itl_p95_ms()
        fill = sum(self.block_ratio) / len(self.block_ratio) if self.block_ratio else 1.0
        pressure = []
        if self.queue_depth > 0:
            pressure.append(f"{self.queue_depth} queued")
        if self.batch_size >= max(1, int(0.75 * c.max_batch)):
            pressure.append(f"batch {self.batch_size}/{c.max_batch}")
        if p95 > 0.9 * c.itl_slo_ms:
            pressure.append(f"ITL p95 {p95:.0f} ms near SLO {c.itl_slo_ms:.0f} ms")
        if pressure:
            if cur.tau < c.tau_max and fill >= 0.6:
                return Decision(cur.tau + 1, c.pressure_min_confidence, "raise τ: " + ", ".join(pressure))
            return Decision(cur.tau, c.pressure_min_confidence, "hold τ under pressure: " + ", ".join(pressure)
                            + (f"; blocks only {fill:.0%} full" if fill < 0.6 else "; τ at max"))
        rest = c.clamp(c.rest_tau)
        headroom = p95 < 0.6 * c.itl_slo_ms and self.queue_depth == 0
        if headroom and cur.tau != rest:
            step = -1 if cur.tau > rest else 1
            return Decision(cur.tau + step, c.rest_min_confidence, "headroom: back toward the operating point")
        return Decision(cur.tau, c.rest_min_confidence if headroom else cur.min_confidence, cur.reason)
