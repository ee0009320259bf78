"""A replica's warm-up: what its first requests would otherwise pay, paid before it reports ready.

Serve counts a replica as ready once its constructor returns (its health check, the gateway's routing, the
chart's readiness probe and a scale-up all follow from that), so the constructor runs this after building the
engine: short generations at every τ the controller can pick, for each profile, alone and as a batch — the
kernels' first calls, the draft policy's first cost measurements, each check width's first passes.
"""

from __future__ import annotations

import time
from typing import Any

from dmtd.engine.sequence import SamplingParams

WARM_TOKENS = 12


def warm_up(engine: Any, tau_max: int, default_profile: str) -> float:
    """Run the warm-up generations on ``engine`` (on the thread that owns it); returns its seconds."""
    t = time.perf_counter()
    text = "Say hello in one short sentence."
    # a tokenizer without a chat template (a base model) warms up on the text, which its completions serve
    prompt: Any = ([{"role": "user", "content": text}] if engine.requests.serves_chat
                   else text if getattr(engine, "tokenizer", None) is not None else list(range(1, 9)))
    exact = [default_profile == "exact", default_profile != "exact"]
    params = [SamplingParams(max_new_tokens=WARM_TOKENS, tau=tau, exact=e, ignore_eos=True)
              for tau in sorted({1, *range(2, tau_max + 1)}) for e in exact]
    engine.generate([prompt], params[0])  # alone: one-row passes
    engine.generate([prompt] * len(params), params)  # a batch: several rows, mixed τ and profiles
    return time.perf_counter() - t
