"""``dmtd eval``: a variant against its base model on held-out prompts.

(a) teacher-forced top-1 agreement with the base at tails and heads, per τ; (b) held-out NLL under DMTD
routing vs the base; (c) free-running greedy generations per τ, judged by the base (perplexity) and by
token agreement with the base's own greedy continuation; (d) batch-1 tokens/s and mean block length per
τ; (e) the quality–speed frontier over a ``min_confidence`` sweep; (f) the exact profile (verified cycles)
per τ: whether its greedy tokens are the verifier's, acceptance overall and by tail position, mean accepted
per cycle, and batch-1 tokens/s over the base model's own τ = 1 on the same prompts. The untrained base with
the same routing is the floor.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.model import LayerWeights, Transformer
from dmtd.engine.outputs import GenerationResult
from dmtd.engine.sequence import SamplingParams
from dmtd.engine.verifier import snapshot_decoding_layers
from dmtd.train.corpus import Record
from dmtd.train.metrics import teacher_forced
from dmtd.train.student import DMTDStudent
from dmtd.variants.build import apply_variant_weights, check_fits_base, read_draft_vocab, variant_verifier
from dmtd.variants.loader import LoadedModel
from dmtd.variants.manifest import VariantManifest
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT


@dataclass(slots=True)
class EvalConfig:
    """How much to evaluate (``quick()`` is the few-minute subset)."""

    taus: list[int] = field(default_factory=lambda: [2, 3, 4])
    num_tf_records: int = 64
    num_prompts: int = 32
    max_new_tokens: int = MAX_NEW_TOKENS_DEFAULT
    confidences: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
    frontier_taus: list[int] = field(default_factory=lambda: [3, 4])
    speed_prompts: int = 3
    speed_tokens: int = 96
    batch_size: int = 16
    max_len: int = 512
    exact_taus: list[int] = field(default_factory=lambda: [2, 3, 4])
    draft_threshold: float | None = None  # the exact profile's draft stop; None = the variant's min_confidence
    dtype: str = "float32"  # of the engines whose outputs are judged and timed (the judge stays float32)
    quant: str = "none"

    @classmethod
    def quick(cls) -> EvalConfig:
        return cls(num_tf_records=16, num_prompts=8, max_new_tokens=64, confidences=[0.0, 0.5, 0.7, 0.9],
                   frontier_taus=[3], speed_prompts=2, speed_tokens=64, batch_size=8, exact_taus=[3])


class Evaluator:
    """Holds the variant (as a student whose teacher is the base), the floor and the base engine."""

    def __init__(self, variant: LoadedModel, manifest: VariantManifest, root: Path, base: LoadedModel,
                 cfg: EvalConfig, device: str = "cpu") -> None:
        self.cfg, self.manifest, self.device = cfg, manifest, device
        self.dmtd = manifest.dmtd_config()
        check_fits_base(variant, manifest)
        # Teacher copies are taken from the untouched base; then the variant's tensors load over the student.
        self.student = DMTDStudent(variant.model, self.dmtd, "all")
        changed = apply_variant_weights(variant, manifest, root)
        self.verifier = variant_verifier(self.dmtd, changed, snapshot_decoding_layers(base.model, self.dmtd))
        self.draft_vocab = read_draft_vocab(manifest, root)
        variant.model.requires_grad_(False)
        self.floor = DMTDStudent(base.model, self.dmtd, "decoding")
        base.model.requires_grad_(False)
        self.base, self.variant = base, variant
        self.tokenizer = base.tokenizer
        L = base.config.num_layers
        self.plain = DMTDConfig.plain(L, 1)

    def engine(self, model: Transformer, dmtd: DMTDConfig, batch: int, exact: bool = False) -> LLMEngine:
        """An engine over ``model``; ``exact``: with the variant's verifier and draft vocabulary, drafting up to
        τ − 1 every cycle (fixed: the acceptance by tail position is what the exact rows report).

        In ``cfg.dtype`` / ``cfg.quant`` (bfloat16: on a bf16 copy of the model and verifier; judging and
        teacher forcing stay float32)."""
        model._weights, model.lm_head_t = None, None  # noqa: SLF001 - weights changed since any earlier engine
        verifier = self.verifier if exact else None
        if self.cfg.dtype == "bfloat16":
            model = copy.deepcopy(model).to(torch.bfloat16)
            if verifier is not None and verifier.layers is not None:
                verifier = dataclasses.replace(verifier, layers=[
                    LayerWeights._make(None if t is None else t.to(torch.bfloat16) for t in w)
                    for w in verifier.layers])
        return LLMEngine(model, self.tokenizer, dmtd,
                         EngineConfig(max_num_seqs=batch, max_model_len=self.cfg.max_len + 64, device=self.device,
                                      dtype=self.cfg.dtype, quant=self.cfg.quant),
                         default_tau=1, verifier=verifier, draft_vocab=self.draft_vocab if exact else None)

    # -- judged generations -----------------------------------------------------------------------
    @torch.no_grad()
    def judge_nll(self, prompts: list[list[int]], outs: list[list[int]]) -> float:
        """Mean NLL of generated tokens under the base model (its perplexity is exp of this)."""
        m, total, count = self.base.model, 0.0, 0
        for a in range(0, len(prompts), self.cfg.batch_size):
            ps, gs = prompts[a: a + self.cfg.batch_size], outs[a: a + self.cfg.batch_size]
            seqs = [p + g for p, g in zip(ps, gs)]
            T = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), T, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
            ids = ids.to(m.embed_tokens.weight.device)
            logp = F.log_softmax(m.forward_masked(ids, torch.ones_like(ids, dtype=torch.bool), self.plain).float(), -1)
            for i, (p, g) in enumerate(zip(ps, gs)):
                if not g:
                    continue
                pos = torch.arange(len(p) - 1, len(p) - 1 + len(g), device=logp.device)
                total -= float(logp[i, pos, torch.tensor(g, device=logp.device)].sum())
                count += len(g)
        return total / max(count, 1)

    def generate(self, engine: LLMEngine, prompts: list[list[int]], tau: int, conf: float = 0.0,
                 ignore_eos: bool = False, max_new: int | None = None, exact: bool = False) -> list[GenerationResult]:
        sp = SamplingParams(max_new_tokens=max_new or self.cfg.max_new_tokens, tau=tau, min_confidence=conf,
                            ignore_eos=ignore_eos, exact=exact)
        return engine.generate(prompts, sp)

    def quality(self, engine: LLMEngine, prompts: list[list[int]], tau: int, ref: list[list[int]] | None,
                conf: float = 0.0) -> dict[str, float]:
        res = self.generate(engine, prompts, tau, conf)
        outs = [r.token_ids for r in res]
        q: dict[str, float] = {"judge_ppl": math.exp(self.judge_nll(prompts, outs)),
                               "gen_mean_block_len": sum(r.mean_block_len for r in res) / len(res)}
        if ref is not None:
            same = sum(sum(a == b for a, b in zip(o, r)) for o, r in zip(outs, ref))
            q["token_agreement"] = same / max(sum(len(r) for r in ref), 1)
            q["prefix_match"] = sum(_prefix(o, r) for o, r in zip(outs, ref)) / len(ref)
        return q

    def speed(self, engine: LLMEngine, prompts: list[list[int]], tau: int, conf: float = 0.0,
              exact: bool = False) -> dict[str, float]:
        """Batch-1 decode tokens/s (prefill excluded) and mean block length."""
        self.generate(engine, prompts[:1], tau, conf, ignore_eos=True, max_new=8, exact=exact)  # warm-up
        n, t, blocks = 0, 0.0, []
        for p in prompts[: self.cfg.speed_prompts]:
            r = self.generate(engine, [p], tau, conf, ignore_eos=True, max_new=self.cfg.speed_tokens, exact=exact)[0]
            n, t = n + len(r.token_ids) - 1, t + r.decode_time_s
            blocks += [len(b) for b in r.blocks]
        return {"tok_s": n / t if t > 0 else 0.0, "mean_block_len": sum(blocks) / max(len(blocks), 1)}

    # -- the exact profile -------------------------------------------------------------------------
    def exact(self, engine: LLMEngine, speed_engine: LLMEngine, prompts: list[list[int]], tau: int,
              threshold: float, ref: list[list[int]], base_tok_s: float) -> dict[str, Any]:
        """Verified cycles at ``tau``: greedy tokens against the verifier's own (``ref``), acceptance overall
        and by tail position, mean accepted per cycle that drafted, batch-1 tok/s over the base's τ = 1."""
        res = self.generate(engine, prompts, tau, threshold, exact=True)
        drafted, accepted = sum(r.num_drafted for r in res), sum(r.num_accepted for r in res)
        by_d = [sum(r.drafted_by_pos[j] for r in res if len(r.drafted_by_pos) > j) for j in range(tau - 1)]
        by_a = [sum(r.accepted_by_pos[j] for r in res if len(r.accepted_by_pos) > j) for j in range(tau - 1)]
        checks = sum(len(r.blocks) - 1 for r in res)  # the first block is the prefill's token
        sp = self.speed(speed_engine, prompts, tau, threshold, exact=True)
        return {
            "tokens_match": sum(r.token_ids == x for r, x in zip(res, ref)) / max(len(ref), 1),
            "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "acceptance_by_pos": [a / d if d else None for a, d in zip(by_a, by_d)],
            "accepted_per_cycle": accepted / by_d[0] if by_d and by_d[0] else None,  # a drafting cycle drafts pos 1
            "tokens_per_cycle": sum(len(r.token_ids) - 1 for r in res) / max(checks, 1),
            "tok_s": sp["tok_s"], "speedup_vs_base_tau1": sp["tok_s"] / max(base_tok_s, 1e-9),
        }

    # -- the whole report -------------------------------------------------------------------------
    def run(self, heldout: list[Record], progress: bool = True) -> dict[str, Any]:
        cfg = self.cfg
        recs = heldout[: cfg.num_tf_records]
        seen: set[int] = set()
        prompts: list[list[int]] = []
        for r in heldout:
            if r.prompt_idx not in seen and len(prompts) < cfg.num_prompts:
                seen.add(r.prompt_idx)
                prompts.append(r.prompt_ids)
        steps = 3 + 3 * len(cfg.taus) + len(cfg.frontier_taus) * len(cfg.confidences) + len(cfg.exact_taus)
        bar = tqdm(total=steps, desc="dmtd eval", disable=not progress, dynamic_ncols=True)

        def tick(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        report: dict[str, Any] = {"variant": self.manifest.name, "tau": {}, "floor": {"tau": {}}, "frontier": []}
        tf_var = teacher_forced(self.student, recs, cfg.taus, cfg.batch_size, cfg.max_len)
        tf_floor = teacher_forced(self.floor, recs, cfg.taus, cfg.batch_size, cfg.max_len)
        tick("teacher-forced")
        base_engine = self.engine(self.base.model, self.plain, cfg.batch_size)
        base_out = [r.token_ids for r in self.generate(base_engine, prompts, 1)]
        base_nll = self.judge_nll(prompts, base_out)
        report["base"] = {"judge_ppl": math.exp(base_nll), "nll": tf_var[cfg.taus[0]]["base_nll"]}
        tick("base greedy")
        var_engine = self.engine(self.variant.model, self.dmtd, cfg.batch_size)
        var_speed = self.engine(self.variant.model, self.dmtd, 1)
        floor_engine = self.engine(self.base.model, self.dmtd, cfg.batch_size)
        t1 = self.speed(var_speed, prompts, 1)
        report["tau1"] = {**self.quality(var_engine, prompts, 1, base_out), **t1}
        report["base"]["tok_s"] = t1["tok_s"]
        tick("τ=1")
        for tau in cfg.taus:
            sp = self.speed(var_speed, prompts, tau)
            report["tau"][str(tau)] = {**tf_var[tau], **self.quality(var_engine, prompts, tau, base_out), **sp,
                                       "speedup": sp["tok_s"] / max(t1["tok_s"], 1e-9)}
            tick(f"variant τ={tau}")
            report["floor"]["tau"][str(tau)] = {**tf_floor[tau], **self.quality(floor_engine, prompts, tau, base_out)}
            tick(f"floor τ={tau}")
            tick(f"speed τ={tau}")
        for tau in cfg.frontier_taus:
            for c in cfg.confidences:
                q = self.quality(var_engine, prompts, tau, base_out, c)
                sp = self.speed(var_speed, prompts, tau, c)
                report["frontier"].append({"tau": tau, "min_confidence": c, **q, **sp,
                                           "speedup": sp["tok_s"] / max(t1["tok_s"], 1e-9),
                                           "ppl_ratio": q["judge_ppl"] / report["base"]["judge_ppl"]})
                tick(f"frontier τ={tau} c={c}")
        if cfg.exact_taus:
            report["exact"] = self.run_exact(prompts, base_out, var_engine, tick)
        bar.close()
        report["operating_point"] = pick_operating_point(report["frontier"])
        return report

    def run_exact(self, prompts: list[list[int]], base_out: list[list[int]], var_engine: LLMEngine,
                  tick: Any) -> dict[str, Any]:
        """The exact profile's section: the base's τ = 1 speed, then one row per τ of ``exact_taus``."""
        cfg = self.cfg
        threshold = self.manifest.exact_draft_threshold() if cfg.draft_threshold is None else cfg.draft_threshold
        # what the exact tokens must equal: the base's greedy tokens, or the variant's own τ = 1 ones
        ref = base_out if self.verifier.name == "base" else [r.token_ids for r in self.generate(var_engine, prompts, 1)]
        base_tok_s = self.speed(self.engine(self.base.model, self.plain, 1), prompts, 1)["tok_s"]
        engine = self.engine(self.variant.model, self.dmtd, cfg.batch_size, exact=True)
        speed_engine = self.engine(self.variant.model, self.dmtd, 1, exact=True)
        out: dict[str, Any] = {"verifier": self.verifier.name, "draft_threshold": threshold,
                               "draft_vocab": len(self.draft_vocab) if self.draft_vocab else None,
                               "base_tau1_tok_s": base_tok_s, "tau": {}}
        for tau in cfg.exact_taus:
            out["tau"][str(tau)] = self.exact(engine, speed_engine, prompts, tau, threshold, ref, base_tok_s)
            tick(f"exact τ={tau}")
        return out


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pick_operating_point(frontier: list[dict[str, Any]], max_ppl_ratio: float = 1.15,
                         min_speedup: float = 1.3) -> dict[str, Any] | None:
    """The fastest frontier point within ``max_ppl_ratio`` of the base's judge perplexity (meets_aim says
    whether it also reaches ``min_speedup``); None when no point is within the quality bound."""
    ok = [p for p in frontier if p["ppl_ratio"] <= max_ppl_ratio]
    if not ok:
        return None
    best = max(ok, key=lambda p: p["speedup"])
    return {**best, "meets_aim": best["speedup"] >= min_speedup}


def headline(report: dict[str, Any], default_tau: int, min_confidence: float, command: str) -> dict[str, Any]:
    """The few numbers a manifest carries (``eval``): per-τ quality and speed, the floor, the default point."""
    def r3(x: float) -> float:
        return round(float(x), 3)

    out: dict[str, Any] = {"command": command, "base_judge_ppl": r3(report["base"]["judge_ppl"]), "tau": {},
                           "floor": {}}
    for t, v in report["tau"].items():
        out["tau"][t] = {k: r3(v[k]) for k in ("tail_agreement", "head_agreement", "judge_ppl", "speedup")}
    for t, v in report["floor"]["tau"].items():
        out["floor"][t] = {k: r3(v[k]) for k in ("tail_agreement", "judge_ppl")}
    if "tau1" in report:
        out["tau1"] = {"judge_ppl": r3(report["tau1"]["judge_ppl"]), "tok_s": r3(report["tau1"]["tok_s"])}
    match = [p for p in report.get("frontier", []) if p["tau"] == default_tau
             and abs(p["min_confidence"] - min_confidence) < 1e-9]
    if match:
        p = match[0]
        out["default_point"] = {"tau": default_tau, "min_confidence": min_confidence, "ppl_ratio": r3(p["ppl_ratio"]),
                                "speedup": r3(p["speedup"]), "mean_block_len": r3(p["mean_block_len"])}
    ex = report.get("exact")
    if ex:
        out["exact"] = {"verifier": ex["verifier"], "draft_threshold": ex["draft_threshold"], "tau": {
            t: {"tokens_match": r3(v["tokens_match"]),
                **{k: None if v[k] is None else r3(v[k]) for k in ("acceptance", "accepted_per_cycle")},
                "acceptance_by_pos": [None if a is None else r3(a) for a in v["acceptance_by_pos"]],
                "speedup_vs_base_tau1": r3(v["speedup_vs_base_tau1"])} for t, v in ex["tau"].items()}}
    op = report.get("operating_point")
    out["operating_point"] = None if op is None else {
        "tau": op["tau"], "min_confidence": op["min_confidence"], "ppl_ratio": r3(op["ppl_ratio"]),
        "speedup": r3(op["speedup"]), "meets_aim": op["meets_aim"]}
    return out
