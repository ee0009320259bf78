"""The engine facade: requests in, per-step token events (with text deltas and DMTD blocks) out."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceT
from typing import Any

import torch

from dmtd.engine import context_drafts
from dmtd.engine.acceptance import check_drafts, pick_drafts
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.draft_choice import DraftChoice
from dmtd.engine.draft_gate import DraftGate
from dmtd.engine.draft_policy import (
    STEADY_CATCH_UP,
    TAIL_PASS_OVERHEAD,
    PassCosts,
)
from dmtd.engine.forks import Forks
from dmtd.engine.logits_process import LogitsShaper
from dmtd.engine.model import Transformer
from dmtd.engine.outputs import Detokenizer, GenerationResult, StepOutput
from dmtd.engine.phrase_table import PhraseTable
from dmtd.engine.runner import ModelRunner
from dmtd.engine.sampler import sample
from dmtd.engine.scheduler import Scheduler, SchedulerOutput, TokenEvent
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence, SequenceStatus
from dmtd.engine.verifier import Verifier, check_draft_vocab


class LLMEngine(DraftChoice):
    """Continuous-batching DMTD engine over one model.

    ``add_request`` validates and queues; ``step`` runs one prefill or decode batch and returns one
    :class:`StepOutput` per token it emitted; ``abort`` frees a request's slot at once. Requests with
    ``exact`` run verified cycles: their tails are drafts (no output) and each head emits the accepted
    drafts plus the verifier's own token (``verifier``: the base model, or the variant's τ = 1 path).
    """

    def __init__(self, model: Transformer, tokenizer: Any, dmtd: DMTDConfig,
                 cfg: EngineConfig | None = None, default_cycle_len: int | None = None,
                 eos_token_ids: list[int] | None = None, verifier: Verifier | None = None,
                 draft_vocab: list[int] | None = None, phrase_table: PhraseTable | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.dmtd = dmtd
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, dmtd, self.cfg, verifier)
        self.scheduler = Scheduler(dmtd, self.cfg.max_num_seqs, self.cfg.max_model_len,
                                   self.cfg.max_prefill_tokens, self.cfg.align_phases, self.cfg.prefill_chunk,
                                   self.cfg.prefix_caching, self.runner.cache.pages)
        self.default_cycle_len = default_cycle_len or dmtd.tau_max
        eos = eos_token_ids if eos_token_ids is not None else list(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(int(tokenizer.eos_token_id))
        self.eos_ids = set(eos)
        self.seqs: dict[str, Sequence] = {}
        self.shaper = LogitsShaper(tokenizer, model.config.vocab_size)  # penalties, logit bias, grammars, logprobs
        self.forks = Forks()  # requests that share a waiting sibling's prefill
        self.forced_drafts = True  # a grammar's forced tokens are drafts of exact greedy requests (_forced_drafts)
        self._detok: dict[str, Detokenizer] = {}
        self._gens: dict[str, torch.Generator | None] = {}
        self._draft_q: dict[str, list[torch.Tensor | None]] = {}
        self.pass_stats: dict[str, list[float]] = {}  # kind -> [calls, seconds] of the model passes (benchmarks)
        self.pass_costs = PassCosts()  # what the draft policy learns of this machine
        self.draft_gate = DraftGate()  # whether drafts pay at all at the batch's size (measured, adaptive drafts)
        # context drafts by n over every request so far, (drafted, accepted) by position: a new request's prior (a
        # 2-token match that is right 1 time in 6 should not be tried a dozen times on every request to learn it)
        self.context_by_pos: context_drafts.Counts = {}
        if phrase_table is not None and phrase_table.vocab_size != model.config.vocab_size:
            raise ValueError(f"phrase_table: made for a vocabulary of {phrase_table.vocab_size}, the model has "
                             f"{model.config.vocab_size}")
        self.phrase_table = phrase_table if self.cfg.phrase_drafts else None
        if draft_vocab is not None:
            self.runner.set_draft_vocab(check_draft_vocab(draft_vocab, model.config.vocab_size, self.eos_ids))

    @property
    def verifier_name(self) -> str:
        """What verified cycles reproduce: ``base`` (the base model) or ``variant`` (its τ = 1 path)."""
        return self.runner.verifier.name

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt: raw ids, text, or chat messages (rendered with the chat template)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "must not be empty")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if prompt and isinstance(prompt[0], dict):
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError("prompt_token_ids", f"token ids must be in 0..{vocab - 1}")
        return ids

    def add_request(self, prompt: str | list[int] | list[dict[str, str]], params: SamplingParams | None = None,
                    req_id: str | None = None, prefill_with: str | None = None) -> str:
        """Queue a request. ``prefill_with``: a sibling request with the same prompt whose prefill this one shares,
        if that is still to come (dmtd.engine.forks); else it is prefilled on its own."""
        params = params or SamplingParams()
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.seqs:
            raise RequestError("request_id", f"{req_id!r} is already in use")
        tau = params.cycle_len if params.cycle_len is not None else self.default_cycle_len
        seq = Sequence(req_id, self.encode(prompt), params, cycle_len=tau)
        self.shaper.add(req_id, params)
        try:
            if not (prefill_with and self.forks.attach(seq, self.seqs.get(prefill_with))):
                self.scheduler.add(seq)
        except RequestError:
            self.shaper.drop(req_id)
            raise
        if params.exact and self.runner.verify_kv is None:
            self.runner.enable_exact()
            # before any draft is measured, a tail costs the share of weight bytes it reads, plus its pass's fixed
            # costs: the flat prior (0.45) tied m = 1 with a plain step at the prior acceptance, so a fresh engine
            # drafted only in its exploring cycles, whose catch-up passes are not measured (draft_policy)
            self.pass_costs.tail_prior = min(self.pass_costs.tail_prior,
                                             self.runner.draft_bytes_share() + TAIL_PASS_OVERHEAD)
        self.seqs[req_id] = seq
        self._detok[req_id] = Detokenizer(self.tokenizer) if self.tokenizer is not None else None  # type: ignore
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self._gens[req_id] = gen
        return req_id

    def set_cycle_len(self, req_id: str, tau: int) -> None:
        """Change a running request's τ; it takes effect at its next head."""
        if not 1 <= tau <= self.dmtd.tau_max:
            raise RequestError("tau", f"must be in 1..{self.dmtd.tau_max}, got {tau}")
        self.seqs[req_id].cycle_len = tau

    def abort(self, req_id: str) -> bool:
        """Cancel a request; its cache slot is free on return. False if it was unknown or done."""
        seq = self.seqs.pop(req_id, None)
        self._detok.pop(req_id, None)
        self._gens.pop(req_id, None)
        self._draft_q.pop(req_id, None)
        self.shaper.drop(req_id)
        if seq is None or seq.finished:
            return False
        if self.forks.detach(req_id) is not None:  # it waited on a sibling's prefill: in no queue
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            return True
        self.scheduler.finish(seq, "abort")
        for kid in self.forks.orphans(req_id):
            self.scheduler.add(kid)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def cache_report(self) -> dict[str, float]:
        """The KV cache's counters: free rows, the pool's pages (in use, peak, cached), preemptions, and the prefix
        cache's lookups, hits and cached share (none without it)."""
        sch = self.scheduler
        out: dict[str, float] = {"free_slots": sch.num_free_slots, "preempted": sch.num_preempted,
                                 **sch.pages.report()}
        if sch.prefix is not None:
            out.update(sch.prefix.report())
        return out

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        t_step = time.perf_counter()
        out = self.scheduler.schedule()
        for s in self.scheduler.take_preempted():  # their drafts went with their pages
            self._draft_q.pop(s.req_id, None)
        if not out.seqs:
            return []
        if out.is_prefill:
            done, rows = [], []
            for s in out.prefill:  # one by one: a prompt's chunks are published before the next one's run
                self.scheduler.reuse(s)
                rows.append(self._timed("prefill", self.runner.prefill, [s])[0])
                done += self.scheduler.prefilled([s])
            if not done:
                return []
            logits = torch.cat(rows)
            out = SchedulerOutput(prefill=done)
            out, logits = self.forks.fork(out, logits, self.scheduler, self.runner.cache)
            results = self._sampled(out, logits)
            conf = {o.req_id: o.confidence for o in results}
            for s in out.prefill:
                if s.params.exact:
                    self._choose_drafts(s)
                    uncertain = conf.get(s.req_id, 1.0) < s.params.min_confidence
                    s.draft_done = s.max_drafts(self.cfg.max_model_len) == 0 or uncertain
                    if s.status is SequenceStatus.RUNNING:
                        self._forced_drafts(s)
                    if s.status is SequenceStatus.RUNNING and not uncertain:
                        self._context_drafts(s)
            return results
        gated = self.cfg.adaptive_drafts and self.cfg.batch_gate
        if gated:
            self.draft_gate.begin_step(len(out.decode))
        results = self._decode(out, t_step)
        if gated:
            self.draft_gate.observe(len(out.decode), len(results), time.perf_counter() - t_step)
        return results

    def _decode(self, out: SchedulerOutput, t_step: float) -> list[StepOutput]:
        """A decode step: plain rows, rows drafting and rows checking, each kind in one pass."""
        plain = [s for s in out.decode if not s.params.exact]
        drafting = [s for s in out.decode if s.params.exact and not s.draft_done]
        checking = [s for s in out.decode if s.params.exact and s.draft_done]
        results = self._sampled(SchedulerOutput(decode=plain), self._timed("decode", self.runner.decode, plain)[0],
                                False) if plain else []
        # a step of one kind costs the draft policy its whole wall time (the pass, picking or checking the tokens,
        # the step's own bookkeeping): each draft is a step of its own, and a policy that counted the pass alone
        # drafted where the steps' ~5 % more made a second draft not pay
        if drafting:
            results += self._draft(drafting, t_step if not (plain or checking) else None)
        if checking:
            results += self._check(checking, t_step if not (plain or drafting) else None)
        self.scheduler.num_decode_steps += 1
        return results

    def _timed(self, kind: str, run: Callable[[list[Sequence]], torch.Tensor],
               seqs: list[Sequence]) -> tuple[torch.Tensor, float]:
        """Run a model pass, count it in ``pass_stats``; returns its output and its seconds."""
        t = time.perf_counter()
        out = run(seqs)
        dt = time.perf_counter() - t
        st = self.pass_stats.setdefault(kind, [0, 0.0])
        st[0] += 1
        st[1] += dt
        return out, dt

    def _sampled(self, out: SchedulerOutput, logits: torch.Tensor, advance_clock: bool = True) -> list[StepOutput]:
        """Sample one token per row of a prefill or plain decode batch, then apply the step."""
        seqs = out.seqs
        logits = self.shaper.rows(logits, seqs)
        tokens, confs, finite = sample(logits, [s.params for s in seqs], [self._gens.get(s.req_id) for s in seqs])
        for i, s in enumerate(seqs):
            self.shaper.record(s.req_id, s.params, logits[i: i + 1], tokens[i: i + 1])
        results = self._fail([s for s, ok in zip(seqs, finite) if not ok])
        if len(results):
            keep = [i for i, ok in enumerate(finite) if ok]
            out = SchedulerOutput(prefill=[seqs[i] for i in keep] if out.is_prefill else [],
                                  decode=[] if out.is_prefill else [seqs[i] for i in keep])
            tokens, confs = [tokens[i] for i in keep], [confs[i] for i in keep]
        for ev in self.scheduler.postprocess(out, tokens, confs, self.eos_ids, advance_clock):
            results.append(self._to_output(ev))
        return results

    def _fail(self, seqs: list[Sequence]) -> list[StepOutput]:
        results = []
        for s in seqs:
            self.scheduler.finish(s, "error", "the model produced non-finite logits")
            results.append(StepOutput(s.req_id, -1, s.next_is_head, math.nan, "", s.block or None, None,
                                      s.cycle_len, True, "error", s.error))
            self._forget(s.req_id)
        return results

    def _draft(self, seqs: list[Sequence], since: float | None = None) -> list[StepOutput]:
        """A tail step of verified cycles: one draft per row, nothing emitted. ``since``: when the step began, if
        it drafts only (its whole time is the draft's cost), else the pass alone is."""
        # positions each row's tail path catches up on in this pass: 1-2 while a request drafts every cycle, more
        # when it resumes after plain steps (one pass over all of them, a one-off that costs about two drafts)
        catch_up = max(s.draft_position - s.num_tail_cached + 1 for s in seqs)
        t0 = time.perf_counter() if since is None else since
        logits, dt = self._timed("draft", self.runner.draft, seqs)
        d = pick_drafts(logits, self.runner.pass_draft_ids, [s.params for s in seqs],
                        [self._gens.get(s.req_id) for s in seqs])
        results = self._fail([s for s, ok in zip(seqs, d.finite) if not ok])
        keep = [i for i, ok in enumerate(d.finite) if ok]
        for i in keep:
            self._draft_q.setdefault(seqs[i].req_id, []).append(d.q[i])
        self.scheduler.postprocess_drafts([seqs[i] for i in keep], [d.tokens[i] for i in keep],
                                          [d.confidences[i] for i in keep], self.eos_ids)
        for i in keep:
            if seqs[i].draft_done:
                self._extend_drafts(seqs[i])
        if catch_up <= STEADY_CATCH_UP:  # a resuming pass is no draft's steady cost: counted, it kept a request that
            # had stopped drafting from ever resuming
            self.pass_costs.observe_draft(len(seqs), time.perf_counter() - t0 if since is not None else dt,
                                          len(self.scheduler.running))
        return results

    def _check(self, seqs: list[Sequence], since: float | None = None) -> list[StepOutput]:
        """A head of verified cycles: check every row's drafts and emit its block (``since``: as for _draft)."""
        logits, dt = self._timed("verify", self.runner.verify, seqs)
        R = logits.shape[1]
        results: list[StepOutput] = []
        for i, s in enumerate(seqs):
            rows, m = self.shaper.check_rows(logits[i, R - len(s.drafts) - 1:], s)
            if m < len(s.drafts):  # the grammar forbids a draft: the drafts end with it
                s.num_extended = max(0, s.num_extended - (len(s.drafts) - m))
                del s.drafts[m:]
            c = check_drafts(rows, s.drafts, self._draft_q.pop(s.req_id, [])[:m], self.runner.draft_ids, s.params,
                             self._gens.get(s.req_id))
            self.shaper.record(s.req_id, s.params, rows, c.tokens)
            if not c.finite:
                results += self._fail([s])
                continue
            generated, context = s.num_generated, s.context_ngram
            tails, extended, ext_source = m - s.num_extended, s.num_extended, s.extension_source
            self._choose_drafts(s)  # before the check is applied: it decides from the new target whether to draft
            events = self.scheduler.postprocess_checked(s, c.tokens, c.num_accepted, c.confidences, self.eos_ids)
            for j, ev in enumerate(events):
                o = self._to_output(ev)
                results.append(o)
                if o.finished:
                    if j < len(events) - 1:  # a stop string ended the block early: it holds what was emitted
                        del s.token_ids[s.prompt_len + generated + j + 1:]
                        o.block, o.block_confidences = c.tokens[: j + 1], c.confidences[: j + 1]
                    # drafts accepted past the end (a stop string, a stop token) were never emitted
                    self._unaccept(s, c.num_accepted, j + 1, context, tails, ext_source, extended)
                    break
            last, accepted = results[-1], min(c.num_accepted, len(results[-1].block or []))
            last.num_drafted, last.num_accepted = m, accepted
            if context:
                last.num_context_drafted, last.num_context_accepted = m, accepted
                context_drafts.count(self.context_by_pos, context, m, accepted)
            elif extended:
                last.num_context_drafted, last.num_context_accepted = extended, max(0, accepted - tails)
                if accepted >= tails:
                    context_drafts.count(self.context_by_pos, ext_source, extended, accepted - tails)
            if not last.finished:
                self._forced_drafts(s)
            if not last.finished and c.confidences[len(events) - 1] >= s.params.min_confidence:
                self._context_drafts(s)
        self.pass_costs.observe_check(len(seqs), R, time.perf_counter() - since if since is not None else dt)
        return results

    def _to_output(self, ev: TokenEvent) -> StepOutput:
        seq = self.seqs[ev.req_id]
        det = self._detok.get(ev.req_id)
        delta = ""
        if det is not None and ev.token_id >= 0 and not (ev.finish_reason == "stop" and ev.token_id in self.eos_ids):
            delta = det.push(ev.token_id)
            hit = self._find_stop(det.text, seq.params.stop, len(delta))
            if hit is not None:
                cut = len(det.text) - hit
                delta = delta[: len(delta) - cut] if cut <= len(delta) else ""
                det.text = det.text[:hit]
                if not ev.finished:
                    self.scheduler.finish(seq, "stop")
                    ev.finished, ev.finish_reason = True, "stop"
                    if ev.block is None:
                        ev.block, ev.block_confidences = seq.block, seq.block_confidences
                        seq.block, seq.block_confidences = [], []
        res = StepOutput(ev.req_id, ev.token_id, ev.is_head, ev.confidence, delta, ev.block, ev.block_confidences,
                         seq.cycle_len, ev.finished, ev.finish_reason)
        lp = self.shaper.emitted(ev.req_id, ev.token_id)
        if not (ev.finish_reason == "stop" and ev.token_id in self.eos_ids):  # an EOS that ends the text is no text
            res.logprob = lp
        if ev.finished:
            self._forget(ev.req_id, keep_seq=True)
        return res

    @staticmethod
    def _find_stop(text: str, stops: list[str], delta_len: int) -> int | None:
        if not stops:
            return None
        best = None
        for s in stops:
            i = text.find(s, max(0, len(text) - delta_len - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _forget(self, req_id: str, keep_seq: bool = False) -> None:
        self._gens.pop(req_id, None)
        self._draft_q.pop(req_id, None)
        self.shaper.drop(req_id)
        if not keep_seq:
            self.seqs.pop(req_id, None)
            self._detok.pop(req_id, None)

    def release(self, req_id: str) -> None:
        """Drop a finished request's bookkeeping."""
        self._forget(req_id)

    # -- conveniences ---------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | list[dict[str, str]],
               params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Run one request alone (plus whatever else is queued) and yield its step outputs."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for o in self.step():
                    if o.req_id == rid:
                        yield o
                        if o.finished:
                            return
        finally:
            self.abort(rid)
            self.release(rid)

    def generate(self, prompts: SequenceT[str | list[int] | list[dict[str, str]]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate for all prompts together (continuous batching) and return results in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        res = {rid: GenerationResult(rid, list(self.seqs[rid].token_ids), [], "", None) for rid in ids}
        t0 = None
        while any(r.finish_reason is None for r in res.values()):
            outs = self.step()
            if t0 is None:
                t0 = time.perf_counter()  # decode time starts after the first (prefill) step
            for o in outs:
                r = res.get(o.req_id)
                if r is None:
                    continue
                if o.token_id >= 0:
                    r.token_ids.append(o.token_id)
                    r.head_flags.append(o.is_head)
                    r.confidences.append(o.confidence)
                r.text += o.text_delta
                if o.logprob is not None:
                    r.logprobs.append(o.logprob)
                if o.block:
                    r.blocks.append(o.block)
                if o.finished:
                    r.finish_reason, r.error = o.finish_reason, o.error
                    r.decode_time_s = time.perf_counter() - (t0 or time.perf_counter())
                    seq = self.seqs.get(o.req_id)
                    if seq is not None:
                        r.num_drafted, r.num_accepted = seq.num_drafted, seq.num_accepted
                        r.num_context_drafted, r.num_context_accepted = (seq.num_context_drafted,
                                                                         seq.num_context_accepted)
                        r.drafted_by_pos, r.accepted_by_pos = list(seq.drafted_by_pos), list(seq.accepted_by_pos)
                    self.release(o.req_id)
        return [res[rid] for rid in ids]
