"""What a grammar costs the engine's thread: compile time and mask time per token, llguidance (the engine's) against
xgrammar where it is importable (it is not a dependency: install it apart, e.g. ``pip install --no-deps --target
/tmp/xgt xgrammar apache-tvm-ffi`` and run with ``PYTHONPATH=/tmp/xgt``).

    .venv/bin/python scripts/grammar_mask_cost.py
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from dmtd.variants.loader import load_model  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 16}}}
TEXT = '{"name": "Ada", "age": 36, "city": "London"}'


def report(name: str, compile_s: float, masks_s: list[float]) -> None:
    """Median and max: on a loaded machine a preempted mask shows as a spike of tens of ms."""
    print(f"{name}: compile {compile_s * 1e3:.1f} ms, mask median {statistics.median(masks_s) * 1e3:.3f} ms, "
          f"max {max(masks_s) * 1e3:.3f} ms over {len(masks_s)} tokens")


def main() -> None:
    tokenizer = load_model().tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152)
    for _ in range(2):  # the process's first matcher pays a one-off set-up: the second is what a request pays
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        compile_s = time.perf_counter() - t0
    mask, times = torch.zeros(1536, dtype=torch.int32), []
    for t in ids:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t)
    report("llguidance", compile_s, times)
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not importable (see this script's docstring)")
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152))
    schema = dict(SCHEMA)
    for i in range(2):  # as above; a distinct schema each time (xgrammar caches compiled schemas)
        schema["title"] = f"s{i}"
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        compile_s = time.perf_counter() - t0
    bitmask, times = xgr.allocate_token_bitmask(1, 49152), []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(t)
    report("xgrammar", compile_s, times)


if __name__ == "__main__":
    main()
