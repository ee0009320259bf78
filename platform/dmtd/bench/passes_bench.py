"""``dmtd bench passes``: where a verified cycle's time goes, pass by pass. One engine (the shipped variant's exact
profile, or ``--variant``; fixed drafts: up to τ − 1 a cycle, tails only), the eight chat prompts of `make demo`,
greedy, at each τ of ``--taus`` in turns (``--rounds`` times: the machine's drift falls on every τ alike). The engine
times its own passes (``LLMEngine.pass_stats``: prefill, draft, verify); this prints per τ the calls and mean
milliseconds of each kind, and prices a cycle in plain steps — (check + drafts × draft pass) ÷ the τ = 1 check —
against the tokens it emits, which is what the draft policy weighs (dmtd.engine.draft_policy).

    bash scripts/quiet.sh .venv/bin/dmtd bench passes --taus 1,2,3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dmtd.bench.exact_bench import CHATS
from dmtd.engine.config import EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.paths import SHIPPED_VARIANTS


def add_passes_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--taus", default="1,2,3", help="cycle lengths, in turns (1 is added: the plain step's price)")
    ap.add_argument("--variant", default="smollm2-135m-dmtd")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--draft-quant", default="auto", help="the drafts' weights (EngineConfig.draft_quant)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", dest="json_path", default=None, metavar="PATH")


def _run(eng: LLMEngine, tau: int, max_new_tokens: int, into: dict[str, Any]) -> None:
    """The chats at ``tau``; adds the engine's pass counts and seconds, the tokens and the checks to ``into``."""
    eng.pass_stats.clear()
    for p in CHATS:
        r = eng.generate([[{"role": "user", "content": p}]], SamplingParams(
            max_new_tokens=max_new_tokens, tau=tau, exact=True, min_confidence=0.0))[0]
        into["tokens"] += len(r.token_ids)
        into["drafted"] += r.num_drafted
        into["accepted"] += r.num_accepted
    for kind, (calls, seconds) in eng.pass_stats.items():
        c, s = into["passes"].get(kind, (0, 0.0))
        into["passes"][kind] = (c + int(calls), s + seconds)


def run_passes_bench(args: argparse.Namespace) -> dict[str, Any]:
    taus = sorted({1, *(int(t) for t in str(args.taus).split(",") if t)})
    for flag, low in (("--taus", taus[0]), ("--rounds", args.rounds), ("--max-new-tokens", args.max_new_tokens)):
        if low < 1:
            raise RequestError(flag, f"must be at least 1, got {low}")
    spec = engine_spec(None, args.variant, dtype=getattr(torch, args.dtype), search_dirs=[SHIPPED_VARIANTS])
    if max(taus) > spec.dmtd.tau_max:
        raise RequestError("--taus", f"the variant's cycles are at most {spec.dmtd.tau_max} long, got {max(taus)}")
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype=args.dtype,
                                          adaptive_drafts=False, draft_quant=args.draft_quant))
    for t in taus:  # warm-up: every pass kind and shape once (kernels built and loaded, TorchScript profiled)
        eng.generate([[{"role": "user", "content": CHATS[0]}]], SamplingParams(max_new_tokens=16, tau=t,
                                                                             exact=True, min_confidence=0.0))
    got: dict[int, dict[str, Any]] = {t: {"tokens": 0, "drafted": 0, "accepted": 0, "passes": {}} for t in taus}
    for _, tau in tqdm([(r, t) for r in range(args.rounds) for t in taus], desc="bench passes", unit="run"):
        _run(eng, tau, args.max_new_tokens, got[tau])
    ms = {t: {k: 1e3 * s / max(c, 1) for k, (c, s) in g["passes"].items()} for t, g in got.items()}
    plain = ms[1]["verify"]  # a τ = 1 check: one position, the verifier alone — a plain step
    rows = []
    for t in taus:
        g, m = got[t], ms[t]
        checks = g["passes"].get("verify", (0, 0.0))[0]
        drafts = g["passes"].get("draft", (0, 0.0))[0]
        cycle = (m["verify"] + (drafts / max(checks, 1)) * m.get("draft", 0.0)) / plain
        per_cycle = g["tokens"] / max(checks, 1)
        rows.append({"tau": t, "tokens": g["tokens"], "checks": checks, "draft_passes": drafts,
                     "check_ms": m["verify"], "draft_ms": m.get("draft"), "prefill_ms": m.get("prefill"),
                     "check_in_plain_steps": m["verify"] / plain,
                     "draft_in_plain_steps": m["draft"] / plain if "draft" in m else None,
                     "cycle_in_plain_steps": cycle, "tokens_per_cycle": per_cycle,
                     "acceptance": g["accepted"] / g["drafted"] if g["drafted"] else None,
                     "expected_speedup": per_cycle / cycle})
    result = {"variant": args.variant, "dtype": args.dtype, "draft_quant": args.draft_quant,
              "draft_format": eng.runner.draft_format, "threads": torch.get_num_threads(),
              "prompts": len(CHATS), "rounds": args.rounds, "rows": rows}
    print(f"\n{args.variant}, {args.dtype}, drafts {eng.runner.draft_format or 'engine'}; {len(CHATS)} chats × "
          f"{args.rounds} round(s), fixed drafts; a plain step (τ = 1 check) {plain:.2f} ms")
    print(f"{'τ':>2} {'checks':>6} {'check ms':>8} {'×plain':>6} {'drafts':>6} {'draft ms':>8} {'×plain':>6} "
          f"{'cycle×':>6} {'tok/cyc':>7} {'accept':>6} {'speedup':>7}")
    for r in rows:
        dm = f"{r['draft_ms']:.2f}" if r["draft_ms"] is not None else "-"
        dp = f"{r['draft_in_plain_steps']:.2f}" if r["draft_in_plain_steps"] is not None else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['tau']:>2} {r['checks']:>6} {r['check_ms']:>8.2f} {r['check_in_plain_steps']:>6.2f} "
              f"{r['draft_passes']:>6} {dm:>8} {dp:>6} {r['cycle_in_plain_steps']:>6.2f} "
              f"{r['tokens_per_cycle']:>7.2f} {acc:>6} {r['expected_speedup']:>7.2f}")
    print("speedup: tokens per cycle ÷ the cycle's price in plain steps (prefill and per-step overheads left out)")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_path}")
    return result
