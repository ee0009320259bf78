"""`dmtd bench autoscale`: replay load traces against tau_aware, replica_only and ray_default.

    python -m dmtd_operator.simulate --json autoscale.json --png autoscale.png

Deterministic for a given --seed. Prints one line per (trace, policy) and optionally writes
{"traces": {trace: {policy: {"slo_attainment", "gpu_hours", "usd_per_1m_tokens", ...}}}, "config": ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dmtd_operator.sim.controllers import POLICY_NAMES, calibrated_target_ongoing, make_controller
from dmtd_operator.sim.model import ReplicaModel
from dmtd_operator.sim.runner import RunSummary, Timeline, run
from dmtd_operator.sim.traces import TRACE_NAMES, make_trace
from dmtd_operator.spec import DMTDDeploymentSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmtd bench autoscale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--traces", default=",".join(TRACE_NAMES), help="comma-separated subset of " + ",".join(TRACE_NAMES)
    )
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated subset of policies")
    p.add_argument("--duration-s", type=float, default=7200.0, help="length of each trace")
    p.add_argument("--dt-s", type=float, default=1.0, help="simulation step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-rps", type=float, default=24.0, help="1x arrival rate, requests/s")
    p.add_argument("--burst-factor", type=float, default=3.0)
    p.add_argument("--burst-ramp-s", type=float, default=90.0, help="time to reach the burst peak")
    p.add_argument("--burst-hold-s", type=float, default=600.0)
    p.add_argument("--noise", type=float, default=0.05, help="relative per-step noise of the arrival rate")
    p.add_argument("--replica-tok-s", type=float, default=2400.0, help="tokens/s of one replica at tau=1")
    p.add_argument("--tau-speedup", default="1.0,1.35,1.55,1.7", help="relative tokens/s at tau=1,2,...")
    p.add_argument("--capacity-json", type=Path, help="measured capacity (overrides the two flags above)")
    p.add_argument("--cold-start-s", type=float, default=120.0)
    p.add_argument("--mean-output-tokens", type=float, default=256.0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=32)
    p.add_argument("--gpus-per-replica", type=int, default=1)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--tau-baseline", type=int, default=1)
    p.add_argument("--tau-max", type=int, default=4)
    p.add_argument("--target-utilization", type=float, default=0.5, help="sizing target at the baseline tau")
    p.add_argument("--interval-s", type=float, default=10.0, help="policy evaluation period")
    p.add_argument("--window-s", type=float, default=30.0, help="metrics window the policy sees")
    p.add_argument("--usd-per-gpu-hour", type=float, default=2.5)
    p.add_argument(
        "--ray-target-ongoing",
        type=float,
        help="ray_default target_ongoing_requests "
        "(default: a replica's ongoing requests at the target utilisation)",
    )
    p.add_argument("--json", type=Path, dest="json_path", help="write results here")
    p.add_argument("--png", type=Path, help="write the replicas/tau/latency figure here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _spec(args: argparse.Namespace, replica_tok_s: float, speedup: tuple[float, ...]) -> DMTDDeploymentSpec:
    return DMTDDeploymentSpec.model_validate(
        {
            "variants": [{"name": "sim", "modelUri": "sim", "weight": 100}],
            "replicas": {"min": args.min_replicas, "max": args.max_replicas},
            "resources": {"gpusPerReplica": args.gpus_per_replica},
            "slo": {"ttftP95Ms": args.ttft_slo_ms, "itlP95Ms": args.itl_slo_ms},
            "tau": {"min": 1, "baseline": args.tau_baseline, "max": args.tau_max},
            "scaling": {
                "coldStartS": args.cold_start_s,
                "intervalS": args.interval_s,
                "targetUtilization": args.target_utilization,
            },
            "capacity": {
                "replicaTokS": replica_tok_s,
                "tauSpeedup": list(speedup),
                "meanOutputTokens": args.mean_output_tokens,
            },
            "cost": {"usdPerGpuHour": args.usd_per_gpu_hour},
        }
    )


def _progress(total: int, disabled: bool) -> Any:
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc="autoscale", file=sys.stderr, mininterval=0.5)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    traces = [t for t in args.traces.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    for name in traces:
        if name not in TRACE_NAMES:
            raise SystemExit(f"unknown trace {name!r}; choose from {', '.join(TRACE_NAMES)}")
    for name in policies:
        if name not in POLICY_NAMES:
            raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if args.capacity_json is not None:
        replica_tok_s, speedup = ReplicaModel.capacity_from_json(args.capacity_json)
    else:
        replica_tok_s, speedup = args.replica_tok_s, tuple(float(x) for x in args.tau_speedup.split(","))
    spec = _spec(args, replica_tok_s, speedup)
    model = ReplicaModel(
        replica_tok_s=replica_tok_s,
        tau_speedup=speedup,
        cold_start_s=args.cold_start_s,
        mean_output_tokens=args.mean_output_tokens,
    )
    target_ongoing = args.ray_target_ongoing or calibrated_target_ongoing(
        spec, itl_ms=model.itl_tau1_ms * 1.25, prefill_ms=model.prefill_ms
    )
    per_replica = replica_tok_s * spec.speedup(spec.tau.baseline) * spec.scaling.target_utilization
    initial = max(
        spec.replicas.min,
        min(spec.replicas.max, math.ceil(args.base_rps * args.mean_output_tokens / per_replica)),
    )

    made = {
        name: make_trace(
            name,
            base_requests_s=args.base_rps,
            duration_s=args.duration_s,
            dt_s=args.dt_s,
            noise=args.noise,
            seed=args.seed,
            burst_factor=args.burst_factor,
            burst_ramp_s=args.burst_ramp_s,
            burst_hold_s=args.burst_hold_s,
        )
        for name in traces
    }
    bar = _progress(sum(len(t.requests_s) for t in made.values()) * len(policies), args.no_progress)
    results: dict[str, dict[str, RunSummary]] = {}
    timelines: dict[str, dict[str, Timeline]] = {}
    for name, trace in made.items():
        for policy in policies:
            controller = make_controller(
                policy,
                spec,
                initial,
                target_ongoing=target_ongoing,
                mean_output_tokens=args.mean_output_tokens,
            )
            summary, timeline = run(
                trace, controller, spec, model, initial_replicas=initial, window_s=args.window_s, progress=bar
            )
            results.setdefault(name, {})[policy] = summary
            timelines.setdefault(name, {})[policy] = timeline
    if bar is not None:
        bar.close()

    header = ("trace", "policy", "SLO att.", "GPU-h", "$/1M tok", "mean tau", "peak")
    print("{:<9} {:<13} {:>9} {:>8} {:>9} {:>9} {:>5}".format(*header))
    for name, per_policy in results.items():
        for policy, s in per_policy.items():
            print(
                f"{name:<9} {policy:<13} {100 * s.slo_attainment:>8.2f}% {s.gpu_hours:>8.2f} "
                f"{s.usd_per_1m_tokens:>9.4f} {s.mean_tau:>9.2f} {s.peak_replicas:>5}"
            )
    if args.json_path is not None:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        config.update(
            replica_tok_s=replica_tok_s,
            tau_speedup=list(speedup),
            initial_replicas=initial,
            ray_target_ongoing=round(target_ongoing, 2),
        )
        payload = {
            "traces": {n: {p: s.to_dict() for p, s in pp.items()} for n, pp in results.items()},
            "config": config,
        }
        args.json_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    if args.png is not None:
        from dmtd_operator.sim.plot import plot

        plot(timelines, args.png, ttft_slo_ms=args.ttft_slo_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
