"""The engine facade: requests in, per-step token events (with text deltas and DMTD blocks) out."""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceT
from typing import Any

import torch

from dmtd.engine import lowbit
from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.forks import Forks
from dmtd.engine.logits_process import LogitsShaper
from dmtd.engine.model import Transformer
from dmtd.engine.outputs import Detokenizer, GenerationResult, StepOutput
from dmtd.engine.phrase_table import PhraseTable
from dmtd.engine.prefill_pacer import CARRIERS, PrefillPacer
from dmtd.engine.requests import RequestState, SequenceView
from dmtd.engine.runner import ModelRunner
from dmtd.engine.sampler import sample
from dmtd.engine.scheduler import Scheduler, SchedulerOutput, TokenEvent
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence, SequenceStatus
from dmtd.engine.verified import VerifiedCycles
from dmtd.engine.verifier import Verifier, check_draft_vocab


class LLMEngine:
    """Continuous-batching DMTD engine over one model.

    ``add_request`` validates and queues; ``step`` runs one prefill or decode batch and returns one
    :class:`StepOutput` per token it emitted; ``abort`` frees a request's cache row at once. Requests with
    ``exact`` run verified cycles: their tails are drafts (no output) and each head emits the accepted
    drafts plus the verifier's own token (``verifier``: the base model, or the variant's τ = 1 path).
    """

    def __init__(self, model: Transformer, tokenizer: Any, dmtd: DMTDConfig,
                 cfg: EngineConfig | None = None, default_tau: int | None = None,
                 eos_token_ids: list[int] | None = None, verifier: Verifier | None = None,
                 draft_vocab: list[int] | None = None, phrase_table: PhraseTable | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.dmtd = dmtd
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, dmtd, self.cfg, verifier)
        # where prompts run as rows, a prompt's bits do not depend on how its prefill is split: the prefix cache
        # shares single pages, and a prompt may be split anywhere while others decode
        self.rows_prefill = self.runner.rows_prefill()
        self.scheduler = Scheduler(dmtd, self.cfg.max_num_seqs, self.cfg.max_model_len,
                                   self.cfg.max_prefill_tokens, self.cfg.align_phases, self.cfg.prefill_chunk,
                                   self.cfg.prefix_caching, self.runner.cache.pages,
                                   self.runner.cache.page_size if self.rows_prefill else None,
                                   self.cfg.long_prefill_tokens)
        # an exact prompt's drafts' KV the runner deferred past its first token is written before its pages go
        self.scheduler.kv.before_release = self._catch_up_for
        # a finished answer's KV serves the conversation's next turn where a decode row computes a position as a
        # prefill does (prompts as rows on the same kernels; not AMX, whose prompt attention runs on tiles), in the
        # groups its readers read: the trunk and the verifier's for exact rows, every group where no tail runs
        if self.rows_prefill and lowbit.loaded_path() != "amx":
            self.scheduler.kv.answers = lambda s: s.params.exact or dmtd.tau_max == 1
        self.pacer = PrefillPacer(self.cfg.prefill_pace)  # how much prompt a step takes while others decode
        self.default_tau = default_tau or dmtd.tau_max
        eos = eos_token_ids if eos_token_ids is not None else list(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(int(tokenizer.eos_token_id))
        self.eos_ids = set(eos)
        self.requests: dict[str, RequestState] = {}  # each request's sequence, detokenizer, generator, drafts' q
        self.seqs = SequenceView(self.requests)  # request id → its Sequence (read-only)
        self.shaper = LogitsShaper(tokenizer, model.config.vocab_size)  # penalties, logit bias, grammars, logprobs
        self.forks = Forks()  # requests that share a waiting sibling's prefill
        self.pass_stats: dict[str, list[float]] = {}  # kind -> [calls, seconds] of the model passes (benchmarks)
        self.num_joined_checks = 0  # steps whose drafting exact rows joined the check most rows made (align_checks)
        if phrase_table is not None and phrase_table.vocab_size != model.config.vocab_size:
            raise ValueError(f"phrase_table: made for a vocabulary of {phrase_table.vocab_size}, the model has "
                             f"{model.config.vocab_size}")
        self.phrase_table = phrase_table if self.cfg.phrase_drafts else None
        self.cycles = VerifiedCycles(self, self.phrase_table)  # the exact profile's drafts: chosen, checked, counted
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
        tau = params.tau if params.tau is not None else self.default_tau
        seq = Sequence(req_id, self.encode(prompt), params, tau=tau)
        gen = None
        if not params.greedy:  # before anything is queued: a seed torch refuses leaves no trace
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.shaper.add(req_id, params)
        self.requests[req_id] = RequestState(seq, detok, gen)
        try:
            if not (prefill_with and self.forks.attach(seq, self.seqs.get(prefill_with))):
                self.scheduler.add(seq)
        except BaseException:  # refused (a RequestError) or broken: the request leaves nothing behind
            self._forget(req_id)
            raise
        if params.exact:
            self.cycles.enable()
        return req_id

    def retune(self, req_id: str, tau: int | None = None, min_confidence: float | None = None) -> None:
        """Change a running request's τ and / or its confidence gate (the replica's controller); a new τ takes
        effect at its next head. Unknown or finished requests are left alone."""
        if tau is not None and not 1 <= tau <= self.dmtd.tau_max:
            raise RequestError("tau", f"must be in 1..{self.dmtd.tau_max}, got {tau}")
        if min_confidence is not None and not 0.0 <= min_confidence <= 1.0:  # NaN fails too
            raise RequestError("min_confidence", f"must be in [0, 1], got {min_confidence}")
        req = self.requests.get(req_id)
        if req is None or req.seq.finished:
            return
        if tau is not None:
            req.seq.tau = tau
        if min_confidence is not None:
            req.seq.params.min_confidence = min_confidence

    def abort(self, req_id: str) -> bool:
        """Cancel a request; its cache row is free on return. False if it was unknown or done."""
        req = self.requests.get(req_id)
        self._forget(req_id)
        if req is None or req.seq.finished:
            return False
        seq = req.seq
        if self.forks.detach(req_id) is not None:  # it waited on a sibling's prefill: in no queue
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            return True
        self.scheduler.finish(seq, "abort")
        for kid in self.forks.orphans(req_id):
            self.scheduler.add(kid)
        return True

    def _catch_up_for(self, seq: Sequence) -> None:
        if self.runner.owes_draft_kv(seq):
            self.runner.catch_up()

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
        out: dict[str, float] = {"free_kv_rows": sch.num_free_kv_rows, "preempted": sch.num_preempted,
                                 **sch.pages.report()}
        if sch.prefix is not None:
            out.update(sch.prefix.report())
        return out

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule a batch, run its passes, postprocess their tokens into per-request outputs."""
        if self.runner.deferred:  # the drafts' KV of the exact prompts the last step gave a first token
            self.timed("catch_up", lambda _: self.runner.catch_up(), [])
        t_step = time.perf_counter()
        sched = self.scheduler
        sched.free_split = self.rows_prefill
        self.pacer.share(len(sched.prefilling) + len(sched.waiting), len(sched.running))
        sched.prefill_budget = self.pacer.budget() if sched.free_split else None
        # (each a least-squares fit over the rides: only while a prompt waits to ride)
        sched.ride_budgets = ({k: self.pacer.ride_budget(k) for k in CARRIERS}
                              if sched.waiting or sched.prefilling else {})
        out = sched.schedule()
        for s in sched.take_preempted():  # their drafts went with their pages
            self.requests[s.req_id].draft_q = []
        if not out.seqs:
            return []
        if out.is_prefill:
            keys, paced = sched.last_prefill_keys, sched.last_prefill_paced
            results = self._prefill(out)
            self.pacer.observe_prefill(keys, 1e3 * (time.perf_counter() - t_step), paced)
            return results
        keys = sched.last_prefill_keys if out.ride else 0.0
        carrier = self._carrier(out.decode)
        results = self._decode(out, t_step)
        ms = 1e3 * (time.perf_counter() - t_step)
        self.pacer.observe_decode(ms, bool(sched.prefilling or sched.waiting))
        if carrier is not None:
            self.pacer.observe_carrier(carrier, ms, keys)
        return results

    @staticmethod
    def _carrier(rows: list[Sequence]) -> str | None:
        """Which carrier (:data:`~dmtd.engine.prefill_pacer.CARRIERS`) a decode step of ``rows`` is, for the pacer's
        timing: a check pass, a step of unverified rows where some reach their heads, or neither."""
        if any(s.params.exact and s.draft_done for s in rows):
            return "check"
        if not any(s.params.exact for s in rows) and any(s.next_is_head for s in rows):
            return "head"
        return None

    def _prefill(self, out: SchedulerOutput) -> list[StepOutput]:
        """A prefill step: each prompt's next chunk; the prompts it finishes sample their first token."""
        done, rows = [], []
        for s in out.prefill:  # one by one: a prompt's chunks are published before the next one's run
            self.scheduler.reuse(s)
            rows.append(self.timed("prefill", self.runner.prefill, [s])[0])
            done += self.scheduler.prefilled([s])
        return self._first_tokens(done, rows)

    def _first_tokens(self, done: list[Sequence], rows: list[torch.Tensor]) -> list[StepOutput]:
        """The prompts a step completed (``done``, their last positions' logits in ``rows``) sample their first
        token (and their forks theirs)."""
        if not done:
            return []
        if self.forks.waiting:  # siblings copy the prompt's KV: all of it
            self.runner.catch_up()
        out, logits = self.forks.fork(SchedulerOutput(prefill=done), torch.cat(rows), self.scheduler,
                                      self.runner.cache)
        results = self._sampled(out, logits)
        conf = {o.req_id: o.confidence for o in results}
        for s in out.prefill:
            if s.params.exact:
                self.cycles.after_prefill(s, conf.get(s.req_id, 1.0))
        return results

    def _decode(self, out: SchedulerOutput, t_step: float) -> list[StepOutput]:
        """A decode step: plain rows, rows drafting and rows checking, each kind in one pass. A step of one kind
        costs the draft policy its whole wall time (the pass, picking or checking the tokens, the step's own
        bookkeeping): each draft is a step of its own, and a policy that counted the pass alone drafted where the
        steps' ~5 % more made a second draft not pay."""
        gate = self.cycles.draft_gate if self.cfg.adaptive_drafts and self.cfg.batch_gate else None
        if gate is not None and not any(s.params.exact and s.tau > 1 for s in out.decode):
            # no row could draft (τ = 1, or the unverified profile): the step is the same in either mode, and
            # counted as a window with drafts it read plain steps as drafts' goodput (a replica's τ = 1 traffic
            # made drafts "pay" at batch 16, and the exact default then ran windows of drafts at 0.5x)
            gate = None
        if gate is not None:
            gate.begin_step(len(out.decode))
            if gate.switched:  # rows between cycles take the new window's mode now, not at their next check
                self.cycles.switch(out.decode)
        plain = [s for s in out.decode if not s.params.exact]
        drafting = [s for s in out.decode if s.params.exact and not s.draft_done]
        checking = [s for s in out.decode if s.params.exact and s.draft_done]
        if self._join_checks(checking, drafting):
            for s in drafting:  # the rest join the check most rows make: their cycles go on in phase with them
                s.draft_done = True
            checking, drafting = [s for s in out.decode if s.params.exact], []
            self.num_joined_checks += 1
        riders: list[Sequence] = []  # prompt chunks riding on the check or the head step (the scheduler's out.ride)
        for s in out.ride:
            self.scheduler.reuse(s)
            if s.num_prefilled < s.prefill_end:
                riders.append(s)
        prompt_logits = None
        # with no check pass, unverified prompts ride on the plain rows' pass (the scheduler's "head" carrier)
        on_plain = riders if plain and not checking and not any(s.params.exact for s in riders) else []
        if plain:
            logits = self.timed("decode", lambda rows: self.runner.decode(rows, on_plain), plain)[0]
            prompt_logits = self.runner.prompt_logits if on_plain else None
            results = self._sampled(SchedulerOutput(decode=plain), logits, False)
        else:
            results = []
        if drafting:
            results += self.cycles.draft(drafting, t_step if not (plain or checking) else None)
        if checking:
            results += self.cycles.check(checking, t_step if not (plain or drafting) else None, riders)
            prompt_logits = self.runner.prompt_logits if riders else None
        elif riders and not on_plain:  # should no pass carry them, they get their own
            prompt_logits = self.timed("prefill", self.runner.prefill, riders)[0]
        self.scheduler.num_decode_steps += 1
        if gate is not None and not riders:  # a step carrying prompt rows measures neither mode
            gate.observe(len(out.decode), len(results), time.perf_counter() - t_step,
                         not any(s.drafts and not s.draft_done for s in out.decode))
        done = self.scheduler.prefilled(out.ride) if out.ride else []
        if done:
            assert prompt_logits is not None and len(prompt_logits) == len(done)
            results += self._first_tokens(done, [prompt_logits])
        return results

    def _join_checks(self, checking: list[Sequence], drafting: list[Sequence]) -> bool:
        """With ``align_checks``: whether the rows still drafting join this step's check — when the checking rows are
        at least as many as any group of drafting rows due to check on one later step (so always where they are half
        of the exact rows). Rows spread evenly over the phases of a cycle (a fixed τ = 3 at batch 16 through the
        stack: 6, 5 and 5 rows) never made half, and each step ran a draft pass and a check pass for ever."""
        if not (self.cfg.align_checks and checking and drafting):
            return False
        due = Counter(s.max_drafts(self.cfg.max_model_len) - len(s.drafts) for s in drafting)
        return len(checking) >= max(due.values())

    def timed(self, kind: str, run: Callable[[list[Sequence]], torch.Tensor],
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
        tokens, confs, finite = sample(logits, [s.params for s in seqs], [self.requests[s.req_id].gen for s in seqs])
        for i, s in enumerate(seqs):
            self.shaper.record(s.req_id, s.params, logits[i: i + 1], tokens[i: i + 1])
        results = self.fail([s for s, ok in zip(seqs, finite) if not ok])
        if len(results):
            keep = [i for i, ok in enumerate(finite) if ok]
            out = SchedulerOutput(prefill=[seqs[i] for i in keep] if out.is_prefill else [],
                                  decode=[] if out.is_prefill else [seqs[i] for i in keep])
            tokens, confs = [tokens[i] for i in keep], [confs[i] for i in keep]
        for ev in self.scheduler.postprocess(out, tokens, confs, self.eos_ids, advance_clock):
            results.append(self.to_output(ev))
        return results

    def fail(self, seqs: list[Sequence]) -> list[StepOutput]:
        results = []
        for s in seqs:
            self.scheduler.finish(s, "error", "the model produced non-finite logits")
            results.append(StepOutput(s.req_id, -1, s.next_is_head, math.nan, "", s.block or None, None,
                                      s.tau, True, "error", s.error))
            self._forget(s.req_id)
        return results

    def to_output(self, ev: TokenEvent) -> StepOutput:
        """A token event as the request's output: its text delta (stop strings end the request), its logprob."""
        req = self.requests[ev.req_id]
        seq, det = req.seq, req.detok
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
                         seq.tau, ev.finished, ev.finish_reason)
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
        """Drop a request's per-request state (all of it, or all but its sequence and text: a finished request's
        result is read after its last output)."""
        self.shaper.drop(req_id)
        if not keep_seq:
            self.requests.pop(req_id, None)
        elif req_id in self.requests:
            self.requests[req_id].gen, self.requests[req_id].draft_q = None, []

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
