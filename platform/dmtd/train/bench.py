"""``dmtd train --bench N``: training tokens/s from the teacher cache against the uncached path, one process.

Trainers over the same corpus, config and initial weights — one recomputing the frozen trunk and the
teacher every step in float32 (the path before the cache), one reading them from the cache with the run's
``compute_dtype``, and, when that is bfloat16, one reading the cache in float32 (each lever on its own) —
take the same N optimizer steps (the same batches: they are a pure function of the step), alternating step
by step so that a shared machine's load falls on all alike. Step 0 warms them up and is not counted.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dmtd.train.config import TrainConfig
from dmtd.train.trainer import Trainer


def _dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[n].detach() - b[n].detach()).float().norm() ** 2) for n in a) ** 0.5


def bench_train(cfg: TrainConfig, steps: int, json_path: Path | None = None) -> dict[str, Any]:
    """Run the comparison, print it, write ``json_path``; returns the result."""
    with tempfile.TemporaryDirectory() as tmp:
        unc = Trainer(cfg.model_copy(update={"cache": None, "compute_dtype": "float32"}), Path(tmp) / "uncached",
                      progress=False)
        t0 = time.perf_counter()
        cac = Trainer(cfg, Path(tmp) / "cached", progress=False)
        open_s = time.perf_counter() - t0
        assert cac.cache is not None
        arms = [("uncached", unc), ("cached", cac)]
        if cfg.compute_dtype != "float32":
            arms.insert(1, ("cached_float32", Trainer(cfg.model_copy(update={"compute_dtype": "float32"}),
                                                      Path(tmp) / "cached32", progress=False)))
        start = unc.state.step
        w0 = {n: p.detach().clone() for n, p in unc.params.items()}
        load = {"before": os.getloadavg()[0]}
        rows: list[dict[str, float]] = []
        for i in tqdm(range(start, start + steps + 1), desc="train bench", unit="step", dynamic_ncols=True):
            row: dict[str, float] = {"step": i}
            for name, tr in arms:
                t = time.perf_counter()
                st = tr.train_step(i)
                row[f"{name}_s"] = time.perf_counter() - t
                row[f"{name}_loss"] = st["loss"]
                row["tokens"] = st["tokens"]
            rows.append(row)
        load["after"] = os.getloadavg()[0]
        counted = rows[1:]
        tokens = sum(r["tokens"] for r in counted)
        res: dict[str, Any] = {"steps": steps, "tokens": tokens, "batch_size": cfg.batch_size,
                               "grad_accum": cfg.grad_accum, "max_len": cfg.max_len, "threads": torch.get_num_threads(),
                               "compute_dtype": cfg.compute_dtype, "arms": [a for a, _ in arms],
                               "loadavg_1m": load, "cache": {"root": str(cac.cache.root),
                                                             "spec": cac.cache.spec.__repr__(),
                                                             "open_and_verify_s": round(open_s, 1),
                                                             "build": cac.cache.build_rate()}}
        for name, _ in arms:
            sec = sum(r[f"{name}_s"] for r in counted)
            res[name] = {"seconds": round(sec, 2), "tok_s": round(tokens / sec, 1),
                         "s_per_step": round(sec / steps, 3)}
        res["ratio"] = round(res["cached"]["tok_s"] / res["uncached"]["tok_s"], 2)
        if "cached_float32" in res:
            res["ratio_cache_only"] = round(res["cached_float32"]["tok_s"] / res["uncached"]["tok_s"], 2)
        res["max_rel_loss_diff"] = max(abs(r["cached_loss"] - r["uncached_loss"]) / max(abs(r["uncached_loss"]), 1e-12)
                                       for r in rows)
        zero = {n: torch.zeros_like(p) for n, p in w0.items()}
        res["param_rel_diff"] = _dist(unc.params, cac.params) / max(_dist(w0, zero), 1e-30)
        res["param_diff_over_update"] = _dist(unc.params, cac.params) / max(_dist(unc.params, w0), 1e-30)
        res["rows"] = rows
    print(f"train bench, {steps} steps × {cfg.batch_size}×{cfg.grad_accum} sequences ({tokens:.0f} tokens), "
          f"{res['threads']} threads, load {load['before']:.1f}→{load['after']:.1f}:")
    for name in res["arms"]:
        print(f"  {name:14s} {res[name]['tok_s']:8.1f} tok/s  ({res[name]['s_per_step']:.2f} s/step)")
    print(f"  ratio {res['ratio']:.2f}×; loss differs by ≤ {res['max_rel_loss_diff']:.2e} (relative), weights after "
          f"{steps} steps by {res['param_rel_diff']:.2e}; cache built at {res['cache']['build']['tok_s']} tok/s, "
          f"verified in {res['cache']['open_and_verify_s']} s")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1) + "\n")
    return res
