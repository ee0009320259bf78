"""PNG of replicas, tau and TTFT over time, one column per trace, one line per policy."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dmtd_operator.sim.runner import Timeline

COLORS = {"tau_aware": "tab:green", "replica_only": "tab:blue", "ray_default": "tab:orange"}


def plot(timelines: Mapping[str, Mapping[str, Timeline]], path: str | Path, *, ttft_slo_ms: float) -> None:
    """Write the figure for `timelines[trace][policy]` to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(timelines)
    fig, axes = plt.subplots(3, len(traces), figsize=(4.2 * len(traces), 8), sharex="col", squeeze=False)
    for col, trace in enumerate(traces):
        ax_r, ax_t, ax_l = axes[0][col], axes[1][col], axes[2][col]
        for policy, tl in timelines[trace].items():
            minutes = [t / 60.0 for t in tl.t_s]
            color = COLORS.get(policy)
            ax_r.plot(minutes, tl.provisioned, color=color, label=policy, linewidth=1.2)
            ax_r.plot(minutes, tl.ready, color=color, linestyle=":", linewidth=0.8)
            ax_t.step(minutes, tl.tau, color=color, where="post", linewidth=1.2)
            ax_l.plot(minutes, [v / 1000.0 for v in tl.ttft_p95_ms], color=color, linewidth=0.8)
        ax_l.axhline(ttft_slo_ms / 1000.0, color="red", linestyle="--", linewidth=0.8, label="TTFT SLO")
        ax_r.set_title(trace)
        ax_l.set_xlabel("minutes")
        ax_l.set_yscale("log")
        if col == 0:
            ax_r.set_ylabel("replicas (dotted: ready)")
            ax_t.set_ylabel("tau upper bound")
            ax_l.set_ylabel("TTFT p95, s")
            ax_r.legend(fontsize=7, loc="upper left")
            ax_l.legend(fontsize=7, loc="upper left")
    fig.suptitle("dmtd bench autoscale")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
