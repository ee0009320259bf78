"""Per-stage breakdown of a ``dmtd bench serve`` run, from the spans the gateway and the replica recorded.

Stages of one request (attributes of its spans, see ``telemetry.gateway`` and ``serve.engine_loop``):

* ``gateway_receive``: from the gateway receiving the call to handing the request to Ray (decode, validate,
  admit, span start);
* ``ray_hop``: the request's way to the replica plus every block's way back (wall clocks of two processes);
* ``replica_queue``: from reaching the replica to admission into the engine (tokenising the prompt included);
* ``engine_step``: wall time of the engine steps the request ran in (shared with the rest of its batch);
* ``dispatch``: from the end of the step that completed a block to the replica handing it to Serve;
* ``client_write``: from a block reaching the gateway to the gateway asking for the next one (conversion to
  protobuf and the gRPC write).

Beside the stages (not one of them: it is part of ``engine_step``), ``engine_step_cpu``: the CPU time of the
engine's thread in those steps; ``engine_step`` minus it is time that thread was preempted or waiting.

Blocks of one request overlap (the engine computes the next while the last travels), so the stages of a
request add up to more than its end-to-end time when the stack pipelines well.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

STAGES = ("gateway_receive", "ray_hop", "replica_queue", "engine_step", "dispatch", "client_write")
MEASURES = STAGES + ("engine_step_cpu",)  # what stage_table reports: the stages and the engine thread's CPU


def _by_request(spans: list[dict[str, Any]], name: str, tag: str) -> dict[str, dict[str, Any]]:
    out = {}
    for s in spans:
        rid = str(s["attributes"].get("dmtd.request_id", ""))
        if s["name"] == name and rid.startswith(tag + "-"):
            out[rid] = s
    return out


def stage_table(gateway: dict[str, dict[str, Any]], replica: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean ms per request and per token of every stage, over the requests both processes recorded."""
    totals = dict.fromkeys(MEASURES, 0.0)
    e2e = tokens = 0.0
    n = 0
    for rid, g in gateway.items():
        r = replica.get(rid)
        if r is None:
            continue
        ga, ra = g["attributes"], r["attributes"]
        n += 1
        tokens += float(ga.get("dmtd.tokens", 0))
        e2e += (g["end_ns"] - g["start_ns"]) / 1e6
        totals["gateway_receive"] += float(ga.get("dmtd.stage.gateway_receive_ms", 0.0))
        totals["ray_hop"] += float(ga.get("dmtd.stage.ray_hop_ms", 0.0)) + float(ra.get("dmtd.stage.ray_hop_ms", 0.0))
        totals["replica_queue"] += float(ra.get("dmtd.stage.replica_queue_ms", 0.0))
        for k in ("engine_step", "engine_step_cpu", "dispatch", "client_write"):
            totals[k] += float(ga.get(f"dmtd.stage.{k}_ms", 0.0))
    if not n:
        return {"requests": 0}
    return {"requests": n, "tokens": tokens, "e2e_ms_per_request": e2e / n,
            "ms_per_request": {k: v / n for k, v in totals.items()},
            "ms_per_token": {k: v / max(tokens, 1.0) for k, v in totals.items()}}


def collect_stages(app: str, tag: str, expected: int | None = None, wait_s: float = 5.0) -> dict[str, Any]:
    """The breakdown of the requests whose ids start with ``tag-``, read from the app's in-memory spans
    (the bench process must be the Ray driver of the stack)."""
    from dmtd.serve.app import finished_spans

    deadline = time.monotonic() + wait_s
    while True:  # the gateway ends a span just after the client has its last block
        gateway = _by_request(finished_spans(app, "Gateway"), "dmtd.gateway.generate", tag)
        if expected is None or len(gateway) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    replica = _by_request(finished_spans(app, "DMTDReplica"), "dmtd.replica.generate", tag)
    return stage_table(gateway, replica)


ROLE_PREFIXES = {"replica": "ray::ServeReplica:dmtd:DMTDReplica", "gateway": "ray::ServeReplica:dmtd:Gateway"}


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds used so far by this process (the load generator, here: ``client``) and by the stack it
    started (its descendants: ``replica``, ``gateway``, and ``ray`` for Ray's and Serve's other processes)."""
    import psutil

    me = psutil.Process()
    out = {"client": sum(me.cpu_times()[:2]), "replica": 0.0, "gateway": 0.0, "ray": 0.0}
    for p in me.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = next((r for r, prefix in ROLE_PREFIXES.items() if cmd.startswith(prefix)), "ray")
        out[role] += t.user + t.system
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU ms per generated token of each process group between two snapshots."""
    return {k: (after[k] - before.get(k, 0.0)) * 1e3 / max(tokens, 1) for k in after}


def plot_stages(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Stacked bars: ms per token in each stage, one bar per closed-loop row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("stages", {}).get("requests")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.6))
    labels = [f"N={r['concurrency']} {r['policy']}" for r in rows]
    left = [0.0] * len(rows)
    for stage in STAGES:
        vals = [r["stages"]["ms_per_token"][stage] for r in rows]
        ax.barh(labels, vals, left=left, label=stage.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    itl = [1e3 / r["tokens_per_s"] * r["concurrency"] for r in rows]
    ax.scatter(itl, labels, color="black", marker="|", s=200, zorder=3, label="wall ms per token per stream")
    ax.invert_yaxis()
    ax.set_xlabel("ms per token (stage time of a request ÷ its tokens)")
    ax.set_title(title or "where a request's time goes")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
