"""The oracle drafter of ``dmtd bench engine`` (``--oracle-acceptance``): a verified cycle's cost at a shape as a
function of its drafts' acceptance.

The exact profile's speedup rests on two things: what a cycle costs (a check over τ rows, τ − 1 draft passes) and
how many of its drafts the verifier accepts. A shape without trained weights has the first but not the second (its
tails' drafts are random). The oracle keeps the cycle whole — the draft passes run, the check decides — and replaces
each tail's token with the base model's own greedy token at that position (known from a τ = 1 run of the same
prompts), wrong on purpose at the rate ``1 − a``: each checked draft is accepted with probability ``a``, independently,
so a cycle emits ``1 + a + … + a^(τ−1)`` tokens on average. The rows then read the speedup of the exact profile at
acceptance ``a`` on this machine, and the output is still the base model's (the rows say whether it was).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

from dmtd.bench import precision_bench as pb
from dmtd.bench.precision_bench import WEIGHT_BYTES
from dmtd.bench.roofline import MachineRates, layer_bytes, lm_head_bytes, step_bytes, token_flops
from dmtd.engine.config import ConfigError, DMTDConfig, ModelConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams, Sequence


def parse_acceptances(text: str) -> list[float]:
    """``--oracle-acceptance``: a comma list of fractions in [0, 1]."""
    out = []
    for part in (p.strip() for p in str(text or "").split(",")):
        if not part:
            continue
        try:
            a = float(part)
        except ValueError:
            a = float("nan")
        if not 0.0 <= a <= 1.0:  # NaN fails too
            raise ConfigError(f"--oracle-acceptance takes a comma list of fractions in [0, 1], e.g. 0,0.5,0.8,1; "
                              f"got {part!r}")
        out.append(a)
    return out


def expected_tokens(acceptance: float, tau: int) -> float:
    """Tokens a cycle of τ emits on average when each draft is accepted with probability ``acceptance``."""
    return sum(acceptance ** k for k in range(tau))


class OracleDrafts:
    """Drafts of the base model's known greedy continuation of each prompt, each wrong with probability
    ``1 − acceptance`` (a wrong draft: the right token + 1). Which positions are wrong is drawn once per request row
    (seeded), so a position redrafted after a rejection before it keeps its draw. Greedy requests only (a
    :class:`~dmtd.engine.draft_sources.TailStandIn`)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], acceptance: float, vocab_size: int,
                 seed: int = 0) -> None:
        self.references, self.acceptance, self.vocab_size, self.seed = references, acceptance, vocab_size, seed
        self._right: dict[str, list[bool]] = {}

    def replace(self, seq: Sequence, token: int) -> int:
        ref = self.references.get(tuple(seq.token_ids[: seq.prompt_len]))
        j = seq.num_generated + len(seq.draft.tokens)
        if ref is None or j >= len(ref):
            return token  # past what the reference knows: the tail's own draft
        right = self._right.get(seq.req_id)
        if right is None:
            rng = random.Random(self.seed * 1_000_003 + len(self._right))
            right = self._right[seq.req_id] = [rng.random() < self.acceptance for _ in ref]
        return ref[j] if right[j] else (ref[j] + 1) % self.vocab_size


def cycle_bound(cfg: ModelConfig, dmtd: DMTDConfig, tau: int, batch: int, context: int, precision: str,
                rates: MachineRates, stream_gb_s: float, draft_stream_gb_s: float | None, tokens_per_cycle: float
                ) -> float:
    """Roofline tok/s of verified cycles: a check (the weights once, the KV of ``batch`` rows, the FLOPs of
    ``batch`` × τ rows) and τ − 1 draft passes (the encoding and decoding layers and the lm_head, in the drafts'
    format: ``draft_stream_gb_s`` is i8dot's rate where the drafts run int8 weights, None for the engine's own),
    ``tokens_per_cycle`` tokens per row."""
    kv_elem = 2 if precision == "bfloat16" else 4
    kv_bytes = step_bytes(cfg, cfg.num_layers, batch, context, elem=kv_elem) - step_bytes(
        cfg, cfg.num_layers, 0, context, elem=kv_elem)
    weights = step_bytes(cfg, cfg.num_layers, 0, context, elem=1) * WEIGHT_BYTES[precision]
    gflop_s = rates.gflop_s(precision) * 1e9
    t_check = max((weights + kv_bytes) / (stream_gb_s * 1e9), batch * tau * token_flops(cfg, context) / gflop_s)
    tail_layers = dmtd.num_encoding_layers + dmtd.num_decoding_layers
    draft_w = WEIGHT_BYTES["i8dot"] if draft_stream_gb_s else WEIGHT_BYTES[precision]
    tail_bytes = (tail_layers * layer_bytes(cfg, 1) + lm_head_bytes(cfg, 1)) * draft_w \
        + kv_bytes * tail_layers / cfg.num_layers
    tail_flops = batch * (2 * tail_layers * layer_bytes(cfg, 1) + 2 * cfg.vocab_size * cfg.hidden_size)
    t_tail = max(tail_bytes / ((draft_stream_gb_s or stream_gb_s) * 1e9), tail_flops / gflop_s)
    return batch * tokens_per_cycle / (t_check + (tau - 1) * t_tail)


def _timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, repeats: int
           ) -> tuple[float, list[Any], dict[str, list[float]]]:
    """The best of ``repeats`` runs: its decode tok/s, results and pass times."""
    best: tuple[float, list[Any], dict[str, list[float]]] = (0.0, [], {})
    for _ in range(max(1, repeats)):
        engine.pass_stats.clear()
        res = engine.generate(prompts, params)
        tok_s = sum(len(r.token_ids) - 1 for r in res) / max(r.decode_time_s for r in res)
        if tok_s > best[0]:
            best = (tok_s, res, {k: list(v) for k, v in engine.pass_stats.items()})
    return best


def _per_call(stats: dict[str, list[float]], kind: str) -> float:
    calls, seconds = stats.get(kind, [0, 0.0])
    return seconds / calls if calls else float("nan")


def oracle_rows(engine: LLMEngine, ids: list[int], batch: int, tau: int, acceptances: list[float], new_tokens: int,
                repeats: int, bound: Callable[[float], float] | None = None) -> list[dict[str, Any]]:
    """At one batch size: the base alone (τ = 1, plain steps) on ``batch`` prompts (``ids`` rotated, one per row),
    then verified cycles of ``tau`` whose drafts the oracle accepts at each rate. ``bound(tokens_per_cycle)``: the
    roofline tok/s of such cycles (None: not computed)."""
    if tau < 2:
        raise ConfigError(f"--oracle-tau must be at least 2 (a cycle with drafts), got {tau}")
    if tau > engine.dmtd.tau_max:
        raise ConfigError(f"--oracle-tau {tau} is above the engine's tau_max {engine.dmtd.tau_max}")
    prompts = [ids[k % len(ids):] + ids[: k % len(ids)] for k in range(batch)]
    plain = SamplingParams(max_new_tokens=new_tokens + 1, tau=1, ignore_eos=True)
    base_tok_s, base_res, base_stats = _timed(engine, prompts, plain, repeats)
    references = {tuple(p): r.token_ids for p, r in zip(prompts, base_res)}
    step_s = _per_call(base_stats, "decode")
    rows: list[dict[str, Any]] = [{"batch": batch, "system": "oracle-base", "tau": 1, "acceptance_set": None,
                                   "tok_s": base_tok_s, "step_s": step_s}]
    stand_in = engine.cycles.tail_stand_in
    exact = SamplingParams(max_new_tokens=new_tokens + 1, tau=tau, exact=True, ignore_eos=True, min_confidence=0.0)
    try:
        engine.cycles.tail_stand_in = OracleDrafts(references, 0.5, engine.runner.model.config.vocab_size)
        engine.generate(prompts, SamplingParams(max_new_tokens=2 * tau + 2, tau=tau, exact=True, ignore_eos=True,
                                                min_confidence=0.0))  # untimed: the check's widths' first passes
        for a in acceptances:
            oracle = OracleDrafts(references, a, engine.runner.model.config.vocab_size)
            engine.cycles.tail_stand_in = oracle
            tok_s, res, stats = _timed(engine, prompts, exact, repeats)
            drafted = sum(r.num_drafted for r in res)
            accepted = sum(r.num_accepted for r in res)
            checks = sum(len(r.blocks) - 1 for r in res)  # the first block is the prefill's token
            first_d = sum(r.drafted_by_pos[0] for r in res if r.drafted_by_pos)
            first_a = sum(r.accepted_by_pos[0] for r in res if r.accepted_by_pos)
            tokens = sum(len(r.token_ids) - 1 for r in res)
            tail_c, check_c = _per_call(stats, "draft") / step_s, _per_call(stats, "verify") / step_s
            per_cycle = tokens / max(checks, 1)
            row: dict[str, Any] = {
                   "batch": batch, "system": f"oracle{a:g}", "tau": tau, "acceptance_set": a, "tok_s": tok_s,
                   "speedup_vs_tau1": tok_s / base_tok_s,
                   "exact": all(tuple(r.token_ids) == tuple(references[tuple(p)]) for p, r in zip(prompts, res)),
                   "first_draft_acceptance": first_a / first_d if first_d else None,
                   "acceptance": accepted / drafted if drafted else None,
                   "tokens_per_cycle": per_cycle, "expected_tokens_per_cycle": expected_tokens(a, tau),
                   "tail_cost": tail_c, "check_cost": check_c,
                   # the passes' own bound: tokens a cycle ÷ its passes' measured cost, in τ = 1 steps
                   "pass_bound_speedup": per_cycle / (check_c + (tau - 1) * tail_c),
                   "draft_format": engine.runner.draft_format or "engine",
                   # where the cycle's time went: passes a row's cycle (3 = τ: one check, τ − 1 drafts, the batch in
                   # phase), and the passes' share of the decode wall time
                   "passes_per_cycle": (stats.get("verify", [0])[0] + stats.get("draft", [0])[0]) * batch
                   / max(checks, 1),
                   "passes_share": (stats.get("verify", [0, 0.0])[1] + stats.get("draft", [0, 0.0])[1])
                   / max(r.decode_time_s for r in res)}
            if bound is not None:
                roof = bound(expected_tokens(a, tau))
                row.update(bound_tok_s=roof, pct_of_bound=tok_s / roof)
            rows.append(row)
    finally:
        engine.cycles.tail_stand_in = stand_in
    return rows


def oracle_section(engine: LLMEngine, ids: list[int], batches: list[int], tau: int, acceptances: list[float],
                   precision: str, new_tokens: int, repeats: int, context: int, rates: MachineRates | None,
                   streams: dict[str, float]) -> list[dict[str, Any]]:
    """The oracle rows at every batch, with their roofline where this machine's rates were measured (``streams``:
    each weight format's streaming rate; i8dot's is measured here if the drafts run int8 weights)."""
    engine.cycles.enable()  # the verifier's KV and the drafts' weights (their format is known from here)
    out = []
    cfg, i8 = engine.runner.model.config, engine.runner.draft_format == "i8dot"
    if rates is not None and i8 and "i8dot" not in streams:
        streams["i8dot"] = pb.stream_gb_s("i8dot")
    for b in batches:
        bound: Callable[[float], float] | None = None
        if rates is not None:
            bound = partial(cycle_bound, cfg, engine.dmtd, tau, b, context, precision, rates, streams[precision],
                            streams["i8dot"] if i8 else None)
        out += oracle_rows(engine, ids, b, tau, acceptances, new_tokens, repeats, bound)
    return out


def print_oracle_table(rows: list[dict[str, Any]], precision: str) -> None:
    if not rows:
        return
    tau = max(r["tau"] for r in rows)
    print(f"\nverified cycles of τ = {tau} with oracle drafts ({precision}; each draft accepted with probability a; "
          "×τ=1: over plain steps of the same prompts; c: a pass ÷ a τ = 1 step)")
    print(f"{'batch':>5} {'a':>5} {'tok/s':>8} {'×τ=1':>6} {'pass bnd':>8} {'tok/cyc':>7} {'expect':>6} "
          f"{'1st acc':>7} {'tail c':>6} {'check c':>7} {'of roof':>7} {'exact':>5}")
    for r in rows:
        if r["tau"] == 1:
            print(f"{r['batch']:>5} {'τ=1':>5} {r['tok_s']:>8.1f}")
            continue
        acc = f"{r['first_draft_acceptance']:.2f}" if r["first_draft_acceptance"] is not None else "-"
        roof = f"{100 * r['pct_of_bound']:.0f}%" if "pct_of_bound" in r else "-"
        print(f"{r['batch']:>5} {r['acceptance_set']:>5.2f} {r['tok_s']:>8.1f} {r['speedup_vs_tau1']:>6.2f} "
              f"{r['pass_bound_speedup']:>8.2f} {r['tokens_per_cycle']:>7.2f} {r['expected_tokens_per_cycle']:>6.2f} "
              f"{acc:>7} {r['tail_cost']:>6.2f} {r['check_cost']:>7.2f} {roof:>7} {'yes' if r['exact'] else 'NO':>5}")


def plot_oracle(rows: list[dict[str, Any]], title: str, path: Any) -> None:
    """Speedup over τ = 1 against the acceptance, one line per batch, measured and the passes' own bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, b in enumerate(sorted({r["batch"] for r in rows})):
        sel = sorted((r for r in rows if r["batch"] == b and r["tau"] > 1), key=lambda r: r["acceptance_set"])
        xs = [r["acceptance_set"] for r in sel]
        colour = f"C{i}"
        ax.plot(xs, [r["speedup_vs_tau1"] for r in sel], "o-", color=colour, label=f"batch {b}")
        ax.plot(xs, [r["pass_bound_speedup"] for r in sel], "--", color=colour, lw=1)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("draft acceptance a (each draft, independently)")
    ax.set_ylabel("tokens/s × plain τ = 1 steps")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8, title="solid: measured; dashed: passes' cost", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
