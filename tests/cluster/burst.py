"""A 3x burst against the running cluster with the operator's loop closed through Prometheus: windows from the
real PromQL (dmtd_operator.prometheus), decisions from the real policy, applied as a new serveConfigV2."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmtd.client import AsyncDMTDClient
from dmtd_operator import policy, render, simulate
from dmtd_operator.metrics import MetricsTarget, MetricsWindow
from dmtd_operator.prometheus import PrometheusMetricsSource
from dmtd_operator.sim.traces import make_trace
from dmtd_operator.spec import DMTDDeploymentSpec
from tests.cluster import kuberay
from tests.cluster.cluster import RayCluster
from tests.cluster.load import StreamResult, stream


@dataclass(frozen=True, slots=True)
class BurstPlan:
    """The trace (dmtd bench autoscale's `burst` shape, compressed) and the policy's knobs, shared by the live run
    and the simulator's prediction."""

    base_rps: float = 0.4
    factor: float = 3.0
    duration_s: float = 180.0
    ramp_s: float = 15.0
    hold_s: float = 75.0
    noise: float = 0.05
    seed: int = 0
    output_tokens: int = 24
    replica_tok_s: float = 40.0
    cold_start_s: float = 20.0
    interval_s: float = 10.0
    window_s: float = 20.0
    ttft_slo_ms: float = 3000.0
    itl_slo_ms: float = 300.0

    def trace(self) -> list[float]:
        return list(make_trace("burst", base_requests_s=self.base_rps, duration_s=self.duration_s, dt_s=1.0,
                               noise=self.noise, seed=self.seed, burst_factor=self.factor,
                               burst_ramp_s=self.ramp_s, burst_hold_s=self.hold_s).requests_s)

    def spec(self, base: dict[str, Any]) -> DMTDDeploymentSpec:
        return DMTDDeploymentSpec.model_validate({
            **base, "slo": {"ttftP95Ms": self.ttft_slo_ms, "itlP95Ms": self.itl_slo_ms},
            "scaling": {"intervalS": self.interval_s, "coldStartS": self.cold_start_s},
            "capacity": {"replicaTokS": self.replica_tok_s, "meanOutputTokens": self.output_tokens},
            "metrics": {"windowS": self.window_s}})

    def predicted(self, workdir: Path) -> dict[str, Any]:
        """`dmtd bench autoscale` (tau_aware) on the same trace and knobs."""
        out = workdir / "autoscale.json"
        simulate.main(["--traces", "burst", "--policies", "tau_aware", "--duration-s", str(self.duration_s),
                       "--base-rps", str(self.base_rps), "--burst-factor", str(self.factor),
                       "--burst-ramp-s", str(self.ramp_s), "--burst-hold-s", str(self.hold_s),
                       "--noise", str(self.noise), "--seed", str(self.seed),
                       "--replica-tok-s", str(self.replica_tok_s), "--cold-start-s", str(self.cold_start_s),
                       "--mean-output-tokens", str(self.output_tokens), "--min-replicas", "1", "--max-replicas",
                       "2", "--ttft-slo-ms", str(self.ttft_slo_ms), "--itl-slo-ms", str(self.itl_slo_ms),
                       "--interval-s", str(self.interval_s), "--window-s", str(self.window_s),
                       "--json", str(out), "--no-progress"])
        run = json.loads(out.read_text())["traces"]["burst"]["tau_aware"]
        return {"slo_attainment": run["slo_attainment"], "replica_s": run["gpu_hours"] * 3600,
                "peak_replicas": run["peak_replicas"], "mean_tau": run["mean_tau"]}


@dataclass
class Evaluation:
    t_s: float
    window: MetricsWindow | None
    decision: policy.Decision


@dataclass
class BurstRun:
    results: list[StreamResult] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    provisioned: list[tuple[float, int]] = field(default_factory=list)  # (t, replicas asked for) at each change
    running: list[tuple[float, int]] = field(default_factory=list)  # (t, RUNNING replicas) sampled
    wall_start: float = 0.0

    def slo_attainment(self, plan: BurstPlan) -> float:
        def met(r: StreamResult) -> bool:
            if not r.ok or r.first_block is None:
                return False
            itl_s = (r.ended - r.first_block) / max(r.tokens - 1, 1)
            return (r.first_block - r.started) * 1e3 <= plan.ttft_slo_ms and itl_s * 1e3 <= plan.itl_slo_ms

        return sum(map(met, self.results)) / len(self.results)

    def replica_s(self, end_s: float) -> float:
        """Replicas asked for, integrated over the trace (the simulator's GPU-seconds at one GPU a replica)."""
        total = 0.0
        for (t, n), (t_next, _) in zip(self.provisioned, [*self.provisioned[1:], (end_s, 0)]):
            total += n * (min(t_next, end_s) - t)
        return total


async def run_burst(cluster: RayCluster, plan: BurstPlan, spec: DMTDDeploymentSpec, prometheus_url: str,
                    registry_url: str, name: str, namespace: str, start: tuple[int, int]) -> BurstRun:
    """Drive the trace (Poisson arrivals at each second's rate) while the operator's loop runs every interval."""
    run = BurstRun(provisioned=[(0.0, start[0])], wall_start=time.time())
    target = cluster.gateway
    t0 = time.monotonic()
    done = asyncio.Event()
    source = PrometheusMetricsSource(prometheus_url)
    state = policy.ScalerState(replicas=start[0], ready_replicas=start[0], tau_max=start[1])

    async def operate() -> None:
        nonlocal state
        applied = (start[0], 1, start[1])
        while not done.is_set():
            await asyncio.sleep(plan.interval_s)
            now = time.monotonic() - t0
            window = await source.fetch(MetricsTarget(namespace, name, plan.window_s))
            decision, state = policy.decide(window, spec, state, now)
            run.evaluations.append(Evaluation(now, window, decision))
            wanted = (decision.replicas, decision.tau_min, decision.tau_max)
            if wanted != applied:
                body = render.ray_service(render.Target(name, namespace, spec, decision.replicas, decision.tau_min,
                                                        decision.tau_max, registry_url))
                await asyncio.to_thread(cluster.submit, kuberay.serve_config(body))
                if decision.replicas != applied[0]:
                    run.provisioned.append((now, decision.replicas))
                applied = wanted

    async def watch() -> None:
        while not done.is_set():
            n = len(await asyncio.to_thread(cluster.running_replicas, "DMTDReplica"))
            run.running.append((time.monotonic() - t0, n))
            await asyncio.sleep(2)

    rng = random.Random(plan.seed)
    tasks: list[asyncio.Task[StreamResult]] = []
    loops = [asyncio.create_task(operate()), asyncio.create_task(watch())]
    async with AsyncDMTDClient(target, timeout_s=300) as client:
        for i, rate in enumerate(plan.trace()):
            for _ in range(_poisson(rng, rate)):
                tasks.append(asyncio.create_task(stream(client, len(tasks), plan.output_tokens)))
            await asyncio.sleep(max(0.0, t0 + i + 1 - time.monotonic()))
        run.results = list(await asyncio.gather(*tasks))
    done.set()
    await asyncio.gather(*loops)
    await source.close()
    return run


def _poisson(rng: random.Random, lam: float) -> int:
    n, p, limit = 0, rng.random(), math.exp(-lam)
    while p > limit:
        n += 1
        p *= rng.random()
    return n
