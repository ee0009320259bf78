"""The block channel against Serve's streamed items, side by side on one stack: two gateways over the same
replica, one with ``block_push auto`` (the default), one with ``block_push off`` (each block, or each stream
interval's blocks, one item of the Serve call). The same closed-loop workload goes through each in turn,
alternating which goes first, ``--rounds`` times; every round gives a ratio, so the machine's drift between
rounds falls on both sides alike. Also the gateways' CPU seconds per generated token.

    bash scripts/quiet.sh .venv/bin/python scripts/ab_block_push.py --concurrency 1,16 --rounds 4 \\
        --json docs/figures/ab_block_push.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="smollm2-135m-dmtd")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--policy", default="tau1")
    ap.add_argument("--requests-per-worker", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from ray import serve
    from tqdm import tqdm

    from dmtd.serve.app import GatewayIngress
    from dmtd.serve.bench import closed_loop
    from dmtd.serve.local import start_stack, stop_stack
    from dmtd.serve.netns import isolate_network

    isolate_network()
    levels = [int(c) for c in args.concurrency.split(",") if c]
    ns = argparse.Namespace(host="127.0.0.1", grpc_port=19100, http_port=18100, registry=None, model=None,
                            decoding_layers=None, replicas=1, max_num_seqs=max(levels), itl_slo_ms=50.0,
                            stream_interval_ms=None, block_push="auto")
    info = start_stack(ns, args.variant)
    try:
        replica = serve.get_deployment_handle("DMTDReplica", app_name="dmtd")
        name = info.get("variant") or args.variant
        off_port = 19101
        gateway: Any = serve.deployment(GatewayIngress, name="Gateway", num_replicas=1,
                                        ray_actor_options={"num_cpus": 0})
        serve.run(gateway.bind({name: replica}, [{"name": name, "status": "active", "traffic_weight": 1.0}], name,
                               "127.0.0.1", off_port, 64, None, None, None, None, None, None, None, "off"),
                  name="dmtd-off", route_prefix="/off")
        targets = {"push": info["grpc"], "off": f"127.0.0.1:{off_port}"}
        pids = {"push": serve.get_deployment_handle("Gateway", app_name="dmtd").info.remote().result(),
                "off": serve.get_deployment_handle("Gateway", app_name="dmtd-off").info.remote().result()}
        assert pids["push"]["block_sink"] is not None and pids["off"]["block_sink"] is None
        gw_pid = {k: int(v["pid"]) for k, v in pids.items()}
        for t in targets.values():  # warm both paths up
            closed_loop(t, args.policy, 1, 1, 16)
        rows: list[dict[str, Any]] = []
        bar = tqdm(total=len(levels) * args.rounds * 2, desc="ab block push", unit="run")
        for n in levels:
            for r in range(args.rounds):
                order = ["push", "off"] if r % 2 == 0 else ["off", "push"]
                row: dict[str, Any] = {"concurrency": n, "round": r, "order": order}
                for side in order:
                    c0 = cpu_s(gw_pid[side])
                    results, wall = closed_loop(targets[side], args.policy, n, args.requests_per_worker,
                                                args.max_new_tokens)
                    tokens = sum(x["tokens"] for x in results)
                    row[f"{side}_tok_s"] = tokens / wall
                    row[f"{side}_gateway_cpu_ms_per_token"] = (cpu_s(gw_pid[side]) - c0) * 1e3 / tokens
                    bar.update()
                row["ratio"] = row["push_tok_s"] / row["off_tok_s"]
                rows.append(row)
        bar.close()
    finally:
        stop_stack()
    print(f"\n{'N':>3} {'round':>5} {'push tok/s':>10} {'off tok/s':>10} {'ratio':>6} {'gw CPU ms/tok push':>19} "
          f"{'off':>5}")
    for row in rows:
        print(f"{row['concurrency']:>3} {row['round']:>5} {row['push_tok_s']:>10.1f} {row['off_tok_s']:>10.1f} "
              f"{row['ratio']:>6.3f} {row['push_gateway_cpu_ms_per_token']:>19.2f} "
              f"{row['off_gateway_cpu_ms_per_token']:>5.2f}")
    summary = {n: statistics.median(r["ratio"] for r in rows if r["concurrency"] == n) for n in levels}
    for n, m in summary.items():
        print(f"N = {n}: median ratio push / off over {args.rounds} rounds: {m:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "median_ratio": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
