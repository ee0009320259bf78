"""Where a verified cycle's time goes, pass by pass: the eight chat prompts of `make demo` at a fixed τ (one
draft a cycle at τ = 2), greedy, the exact profile of the shipped variant (or ``--variant``), bf16 engine.

    bash scripts/quiet.sh .venv/bin/python scripts/pass_costs.py --tau 2
    bash scripts/quiet.sh .venv/bin/python scripts/pass_costs.py --tau 1

Prints the mean milliseconds of each kind of engine step (a check, a draft, the prefill) and of the parts of a
draft step — the draft layers (`dmtd::draft_layers`, the encoding group and then the decoding group), the draft
head, picking the drafts — and of checking them. Run it at τ = 1 and τ = 2 one after the other to price a cycle
in plain steps: (check + draft step) ÷ the τ = 1 check. Timers wrap the engine's methods (a few µs each).
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from dmtd.bench.exact_bench import CHATS
from dmtd.cli import SHIPPED_VARIANTS
from dmtd.engine import llm
from dmtd.engine.config import EngineConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--variant", default="smollm2-135m-dmtd")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-quant", default="auto", help="the drafts' weights (EngineConfig.draft_quant)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = engine_spec(None, args.variant, None, dtype=torch.bfloat16, device="cpu", search_dirs=[SHIPPED_VARIANTS])
    eng = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=4096, dtype="bfloat16",
                                          adaptive_drafts=False, draft_quant=args.draft_quant))
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()

    def timed(obj: Any, name: str, key: Callable[..., str] | str) -> None:
        f = getattr(obj, name)

        def g(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = f(*a, **k)
            label = key(*a) if callable(key) else key
            total[label] += time.perf_counter() - t
            count[label] += 1
            return out
        setattr(obj, name, g)

    runner = eng.runner
    timed(runner, "_draft_stack", lambda h, start, end, *rest: f"  draft layers {start}-{end}")
    timed(runner, "_draft_logits", "  draft head")
    timed(runner, "draft", " draft pass")
    timed(runner, "verify", " check pass")
    timed(llm, "pick_drafts", "  picking the drafts")
    timed(llm, "check_drafts", "  checking the drafts")
    step = eng.step

    def classify() -> list:
        before = count[" draft pass"], count[" check pass"]
        t = time.perf_counter()
        out = step()
        kind = ("draft step" if count[" draft pass"] > before[0] else
                "check step" if count[" check pass"] > before[1] else "prefill step")
        total[kind] += time.perf_counter() - t
        count[kind] += 1
        return out
    eng.step = classify  # type: ignore[method-assign]

    def run() -> int:
        n = 0
        for p in CHATS:
            r = eng.generate([[{"role": "user", "content": p}]], SamplingParams(
                max_new_tokens=args.max_new_tokens, cycle_len=args.tau, exact=True, min_confidence=0.0))[0]
            n += len(r.token_ids)
        return n

    eng.generate([[{"role": "user", "content": CHATS[0]}]], SamplingParams(max_new_tokens=16, cycle_len=args.tau,
                                                                         exact=True, min_confidence=0.0))
    total.clear()
    count.clear()
    tokens = run()
    print(f"τ = {args.tau}, {args.variant}: {tokens} tokens over {len(CHATS)} prompts")
    order = ["check step", " check pass", "  checking the drafts", "draft step", " draft pass",
             *sorted(k for k in total if k.startswith("  draft layers")), "  draft head", "  picking the drafts",
             "prefill step"]
    for k in order:
        if count[k]:
            print(f"{k:28s} {count[k]:5d} × {1e3 * total[k] / count[k]:8.3f} ms")


if __name__ == "__main__":
    main()
