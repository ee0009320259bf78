"""Batch invariance on the kernel path of this process (``DMTD_KERNEL_PATH``), run by test_batch_invariance.py in a
subprocess per path: one request alone against the same request inside batches of 2..64 companions (mixed prompt
lengths, τ, phases, profiles, greedy and sampled), for every weight format. Prints one JSON line: the path loaded,
the cases run and every difference found (tokens, or the bits of the logits that chose an emitted token). Two cases
have the request arrive while dmtd-profile rows decode, its prompt riding on their head step, and later prompts riding
on its own."""

from __future__ import annotations

import copy
import json
import random
import sys
from dataclasses import replace
from typing import Any

import torch

from dmtd.engine import lowbit
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from tests.engine.test_exact import base_model, in_dtype, prompts_of, variant_of

DMTD = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")


class Recorder:
    """The logits row behind each position's prediction, per request, from the runner's prefill, plain decode and
    verify passes (the passes whose logits choose emitted tokens): ``rows[req_id][q] = (inputs 0..q, logits)``; a
    position computed again (after a rejected draft) keeps its last computation."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[str, dict[int, tuple[tuple[int, ...], torch.Tensor]]] = {}
        r = engine.runner
        prefill, decode, verify = r.prefill, r.decode, r.verify

        def keep(s: Any, inputs: list[int], row: torch.Tensor) -> None:
            self.rows.setdefault(s.req_id, {})[len(inputs) - 1] = (tuple(inputs), row.detach().float().clone())

        def on_prefill(seqs: list[Any]) -> torch.Tensor:
            out = prefill(seqs)
            for i, s in enumerate(seqs):
                keep(s, list(s.token_ids), out[i])
            return out

        def on_decode(seqs: list[Any], prompts: list[Any] | None = None) -> torch.Tensor:
            out = decode(seqs, prompts)
            for i, s in enumerate(seqs):
                keep(s, list(s.token_ids), out[i])
            riding(prompts)
            return out

        def riding(prompts: list[Any] | None) -> None:  # prompts riding on a check or a head step
            for k, s in enumerate(s for s in prompts or [] if s.prefill_end == s.num_tokens):
                keep(s, list(s.token_ids), r.prompt_logits[k])

        def on_verify(seqs: list[Any], prompts: list[Any] | None = None) -> torch.Tensor:
            inputs = [(list(s.token_ids), list(s.draft.tokens)) for s in seqs]
            out = verify(seqs, prompts)
            R = out.shape[1]
            for i, (s, (toks, drafts)) in enumerate(zip(seqs, inputs)):
                for j in range(len(drafts) + 1):
                    keep(s, toks + drafts[:j], out[i, R - len(drafts) - 1 + j])
            riding(prompts)
            return out

        r.prefill, r.decode, r.verify = on_prefill, on_decode, on_verify  # type: ignore[method-assign]

    def final(self, req_id: str, tokens: list[int], prompt_len: int) -> list[torch.Tensor]:
        """The rows that chose each emitted token, checked to have been computed from the final inputs."""
        rows = self.rows[req_id]
        out = []
        for q in range(prompt_len - 1, len(tokens) - 1):
            inputs, row = rows[q]
            assert list(inputs) == tokens[: q + 1], f"position {q}: last computed from other inputs"
            out.append(row)
        return out


def run(dtype: str, quant: str, dmtd: DMTDConfig, batch: list[tuple[list[int], SamplingParams]],
        target: int, arrive: dict[int, int] | None = None,
        arch: dict[str, bool] | None = None, kv: str = "auto") -> tuple[list[int], list[torch.Tensor], int]:
    """The target's generated tokens, the logits rows that chose them, and the decode steps that carried prompt rows;
    ``arrive``: the step at which batch entry i arrives (else at once): a late prompt may ride on the others' step;
    ``arch``: the model's architecture switches (Qwen's qkv bias and per-head q/k norms), else a Llama's; ``kv``: the
    engine's kv_cache_dtype."""
    arrive = arrive or {}
    base = base_model(5, 0.05, **(arch or {}))
    var, verifier = variant_of(base, 0.02, 5)
    var, verifier = in_dtype(var, verifier, dtype)
    engine = LLMEngine(var, None, dmtd, EngineConfig(max_num_seqs=64, max_model_len=256, dtype=dtype, quant=quant,
                                                     kv_cache_dtype=kv),
                       default_tau=1, eos_token_ids=[], verifier=verifier)
    rec = Recorder(engine)
    ids = {i: engine.add_request(p, params) for i, (p, params) in enumerate(batch) if i not in arrive}
    res: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or len(ids) < len(batch):
        ids.update({i: engine.add_request(*batch[i]) for i, at in arrive.items() if at == step})
        for o in engine.step():
            if o.finished:
                res[o.req_id] = list(engine.seqs[o.req_id].token_ids) if o.req_id in engine.seqs else []
        step += 1
    seq_tokens = res[ids[target]]
    prompt = batch[target][0]
    assert seq_tokens[: len(prompt)] == prompt
    return seq_tokens[len(prompt):], rec.final(ids[target], seq_tokens, len(prompt)), engine.scheduler.num_rides


def companions(n: int, rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(n):
        prompt = prompts_of([rng.randint(1, 40)], rng.randint(0, 10_000))[0]
        sampled = rng.random() < 0.3
        out.append((prompt, SamplingParams(max_new_tokens=rng.randint(1, 16), tau=rng.randint(1, 4),
                                           exact=rng.random() < 0.5, min_confidence=rng.choice([0.0, 0.3]),
                                           temperature=0.8 if sampled else 0.0, seed=i if sampled else None)))
    return out


def second_turns(dtype: str, kv: str = "auto") -> dict[str, Any]:
    """Answers reused on this path: each conversation's turn 1 in the exact profile on an engine with the prefix
    cache, then turn 2 (turn 1's prompt, its answer, a new message), which reads the published answer's pages; its
    tokens against the base model's alone on an engine without any cache. Returns the diffs and the tokens turn 2
    found cached."""
    base = base_model(5, 0.05)
    var, verifier = in_dtype(*variant_of(base, 0.02, 5), dtype)
    dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, dtype=dtype, kv_cache_dtype=kv)
    e = LLMEngine(var, None, dmtd, cfg, default_tau=1, eos_token_ids=[], verifier=verifier)
    plain = copy.deepcopy(base).to(getattr(torch, dtype))  # the base model itself: every layer, every token
    ref = LLMEngine(plain, None, dmtd, replace(cfg, prefix_caching=False), default_tau=1, eos_token_ids=[])
    diffs, cached = [], 0
    for i, (n, tail) in enumerate([(40, 5), (23, 9), (57, 3)]):
        turn1, extra = prompts_of([n], 100 + i)[0], prompts_of([tail], 200 + i)[0]
        answer = e.generate([turn1], SamplingParams(max_new_tokens=30, tau=3, exact=True))[0].token_ids
        turn2 = turn1 + answer + extra
        before = e.scheduler.prefix.stats.cached_tokens
        got = e.generate([turn2], SamplingParams(max_new_tokens=20, tau=3, exact=True))[0].token_ids
        cached += e.scheduler.prefix.stats.cached_tokens - before
        want = ref.generate([turn2], SamplingParams(max_new_tokens=20))[0].token_ids
        if got != want:
            diffs.append(f"{dtype} conversation {i}: turn 2 {got} != the base alone {want}")
    return {"diffs": diffs, "cached_tokens": cached, "publishes": e.scheduler.kv.answers is not None}


def main() -> None:
    lowbit.load_kernels()
    rng = random.Random(0)
    targets = [SamplingParams(max_new_tokens=20, tau=1), SamplingParams(max_new_tokens=20, tau=3,
                                                                              exact=True),
               SamplingParams(max_new_tokens=20, tau=2)]
    prompt = prompts_of([13], 7)[0]
    cases, diffs = 0, []
    # (dtype, quant, phase anchor, batch sizes, targets): bf16 at full width, the low-bit formats narrower
    plan = [("bfloat16", "none", "prompt_end", (64,), targets), ("bfloat16", "none", "absolute", (9,), targets),
            ("float32", "int8", "prompt_end", (17,), targets[:2]), ("float32", "int4", "absolute", (5,), targets[1:])]
    qwen = {"qkv_bias": True, "qk_norm": True}  # a Qwen-shaped model: the rows op's bias and q/k-norm branches
    # and a dmtd-profile request arriving while only dmtd-profile rows decode: its prompt rides on their head step,
    # later ones on its (heads at absolute positions: its tokens do not depend on when it joined)
    late = SamplingParams(max_new_tokens=20, tau=2)
    # and a bfloat16 KV cache (kv_cache_dtype; not on the amx path, which keeps float32)
    kv16 = lowbit.loaded_path() != "amx"
    for dtype, quant, anchor, sizes, tgts, arch, kv in [(*p, None, "auto") for p in plan] + [
            ("bfloat16", "none", "absolute", (6,), [late], None, "auto"),
            ("float32", "int8", "absolute", (6,), [late], None, "auto"),
            ("bfloat16", "none", "prompt_end", (12,), targets[:2], qwen, "auto")] + [
            ("bfloat16", "none", "prompt_end", (12,), targets[:2], None, "bfloat16")] * kv16:
        dmtd = DMTDConfig(0, 4, 2, tau_max=4, head_input="replace", phase_anchor=anchor)
        for t in tgts:
            alone_tokens, alone_rows, _ = run(dtype, quant, dmtd, [(prompt, t)], 0, arch=arch, kv=kv)
            for n in sizes:
                batch = companions(n - 1, rng)
                if t is late:
                    batch = [(p, replace(q, exact=False, max_new_tokens=16)) for p, q in batch]
                k = rng.randint(0, n - 1)
                batch.insert(k, (prompt, t))
                # late: the request rides on the others' head step, and later arrivals ride on its own
                arrive = {k: 2, **{i: 5 for i in range(0, n, 2) if i != k}} if t is late else {}
                tokens, rows, rides = run(dtype, quant, dmtd, batch, k, arrive, arch, kv)
                cases += 1
                what = (f"{dtype}/{quant}{' qwen' if arch else ''} kv {kv} {anchor} τ={t.tau} exact={t.exact} in {n} "
                        f"at {k}")
                if t is late and not rides:
                    diffs.append(f"{what}: the late prompt did not ride")
                if tokens != alone_tokens:
                    diffs.append(f"{what}: tokens {tokens} != alone {alone_tokens}")
                elif len(rows) != len(alone_rows) or not all(torch.equal(a, b) for a, b in zip(rows, alone_rows)):
                    bad = next((i for i, (a, b) in enumerate(zip(rows, alone_rows)) if not torch.equal(a, b)), -1)
                    diffs.append(f"{what}: logits bits differ at generated position {bad}")
    turns = second_turns("bfloat16")
    turns16 = second_turns("bfloat16", "bfloat16") if kv16 else None
    print(json.dumps({"path": lowbit.loaded_path(), "cases": cases, "diffs": diffs, "second_turns": turns,
                      "second_turns_kv16": turns16}))


if __name__ == "__main__":
    sys.exit(main())
