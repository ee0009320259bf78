"""The training levers, measured side by side: short runs that differ in one setting each, from the same start,
on the same corpus snapshot, scored on the same held-out split (``dmtd train``'s own held-out evaluation).

    W=~/.cache/dmtd/corpora/smollm2-sd-wide
    dmtd data --out $W-s2 --snapshot-of $W --shards 2          # a fixed snapshot: every arm sees the same data
    nohup nice -n 19 .venv/bin/python scripts/train_levers.py --corpus $W-s2 \\
        --json docs/figures/train_levers.json >> ~/.cache/dmtd/logs/train-levers.log 2>&1 &

Each arm is a ``dmtd train`` run under ``--runs-root`` (checkpointed: rerun the same command after a restart
and each arm resumes where it stopped; finished arms are read from their logs). A new arm first makes the
teacher cache its E and D need (``dmtd cache`` over ``--cache-root``'s shards: by default the snapshot's own,
a few minutes; a shard already cached is checked and kept). The JSON and the printed markdown table hold the
held-out top-1 agreement by τ at every evaluation of every arm, ranked by the last one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# name: (E, D, extra `dmtd train` arguments). The reference arm is "d8"; each other arm changes one thing. A name
# is also the run's variant name (lever-<name>), so it keeps to lowercase letters, digits, '.', '_' and '-'.
ARMS: dict[str, tuple[int, int, list[str]]] = {
    "d8": (0, 8, []),
    "d8-kl-ce": (0, 8, ["--ce-weight", "0.5"]),
    "d8-tau4-fixed": (0, 8, ["--tau-min", "4", "--tau-max", "4"]),
    "d8-lr1e-3": (0, 8, ["--lr", "1e-3"]),
    "d8-lr3e-3": (0, 8, ["--lr", "3e-3"]),
    "d8-lr-flat": (0, 8, ["--min-lr-ratio", "1.0"]),
    "d6": (0, 6, []),
    "d10": (0, 10, []),
    "e1-d8": (1, 8, []),
    "e2-d8": (2, 8, []),
    "e2-d8-lr1e-3": (2, 8, ["--lr", "1e-3"]),  # the two strongest levers together
}


def dmtd() -> str:
    return str(Path(sys.executable).with_name("dmtd"))


def read_evals(run: Path) -> list[dict]:
    log = run / "log.jsonl"
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "tokens_seen": r.get("tokens_seen"), "eval": r["eval"]} for r in rows if "eval" in r]


def finished(run: Path, steps: int) -> bool:
    return any(e["step"] >= steps for e in read_evals(run))


def run_arm(name: str, args: argparse.Namespace) -> None:
    enc, dec, extra = ARMS[name]
    run = args.runs_root / name
    cache = args.cache_root / f"cache-e{enc}-d{dec}-k{args.top_k}-bfloat16"
    if not (run / "config.json").exists():  # a new arm: the cache its E and D need (a done shard is kept)
        subprocess.run([dmtd(), "cache", "--corpus", str(args.cache_root), "--num-encoding-layers", str(enc),
                        "--num-decoding-layers", str(dec), "--top-k", str(args.top_k), "--threads",
                        str(args.threads)], check=True)
    if (run / "config.json").exists():  # resume exactly where it stopped
        cmd = [dmtd(), "train", "--run-dir", str(run)]
    else:
        cmd = [dmtd(), "train", "--name", f"lever-{name}", "--run-dir", str(run), "--corpus", str(args.corpus),
               "--cache", str(cache), "--num-encoding-layers", str(enc), "--num-decoding-layers", str(dec),
               "--max-steps", str(args.steps), "--eval-every", str(max(1, args.steps // args.evals)),
               "--eval-records", str(args.eval_records), "--checkpoint-every", "25", "--keep-checkpoints", "2",
               "--compute-dtype", "bfloat16", "--threads", str(args.threads), "--seed", str(args.seed), *extra]
        if args.init_from and dec == 8 and enc == 0:
            cmd += ["--init-from", str(args.init_from)]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"train_levers: {name} done in {time.monotonic() - t0:.0f} s", flush=True)


def table(rows: list[dict]) -> str:
    taus = sorted({t for r in rows for e in r["evals"] for t in e["eval"]}, key=int)
    out = ["| arm | change | step | " + " | ".join(f"τ={t}" for t in taus) + " |",
           "|---|---|---:|" + "---:|" * len(taus)]
    for r in sorted(rows, key=lambda r: -(r["evals"][-1]["eval"].get("2", 0) if r["evals"] else 0)):
        if not r["evals"]:
            continue
        last = r["evals"][-1]
        out.append(f"| {r['arm']} | {r['change']} | {last['step']} | "
                   + " | ".join(f"{last['eval'].get(t, float('nan')):.3f}" for t in taus) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, steps: int) -> None:
    """Held-out agreement at τ = 2 (τ = 4 for an arm that trains only τ = 4) against step, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in sorted(rows, key=lambda r: -(r["evals"][-1]["eval"].get("2", 0) if r["evals"] else 0)):
        tau = "2" if any("2" in e["eval"] for e in r["evals"]) else "4"
        pts = [(e["step"], e["eval"][tau]) for e in r["evals"] if tau in e["eval"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{r['arm']} ({r['change']}; τ = {tau})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out tail top-1 agreement with the base")
    ax.set_xlim(0, steps)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("scripts/train_levers.py: one change per arm, from the base model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="the snapshot every arm trains and evaluates on")
    ap.add_argument("--cache-root", type=Path, default=None, help="corpus whose teacher caches are used "
                    "(the snapshot's source; default --corpus)")
    ap.add_argument("--runs-root", type=Path, default=Path.home() / ".cache" / "dmtd" / "runs" / "levers")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma list of " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--evals", type=int, default=3, help="held-out evaluations per arm (the last at --steps)")
    ap.add_argument("--eval-records", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="variant the E0/D8 arms start from (default: the base model, like the others)")
    ap.add_argument("--report-only", action="store_true", help="only collect the arms' logs")
    ap.add_argument("--json", type=Path, default=None, help="write the arms' curves here, and a PNG beside it")
    args = ap.parse_args()
    args.corpus, args.runs_root = args.corpus.expanduser(), args.runs_root.expanduser()
    args.cache_root = (args.cache_root or args.corpus).expanduser()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"train_levers: --arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}",
              file=sys.stderr)
        return 2
    for name in arms:
        if args.report_only or finished(args.runs_root / name, args.steps):
            continue
        run_arm(name, args)
    rows = []
    for name in arms:
        enc, dec, extra = ARMS[name]
        rows.append({"arm": name, "num_encoding_layers": enc, "num_decoding_layers": dec, "args": extra,
                     "change": ", ".join(([f"E={enc}, D={dec}"] if (enc, dec) != (0, 8) else [])
                                         + ([" ".join(extra)] if extra else [])) or "reference",
                     "evals": read_evals(args.runs_root / name)})
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"corpus": str(args.corpus), "steps": args.steps,
                                         "eval_records": args.eval_records, "seed": args.seed,
                                         "init_from": str(args.init_from) if args.init_from else None,
                                         "arms": rows}, indent=1) + "\n")
        plot(rows, args.json.with_suffix(".png"), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
