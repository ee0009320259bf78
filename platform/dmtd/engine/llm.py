"""The engine facade: requests in, per-step token events (with text deltas and DMTD blocks) out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from collections.abc import Sequence as SequenceT
from typing import Any

from dmtd.engine import lowbit
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.forks import Forks
from dmtd.engine.logits_process import LogitsShaper
from dmtd.engine.model import LayerWeights, Transformer
from dmtd.engine.outputs import GenerationResult, StepOutput
from dmtd.engine.pass_timer import PassTimer
from dmtd.engine.phrase_table import PhraseTable
from dmtd.engine.prefill_pacer import PrefillPacer
from dmtd.engine.request_processor import Prompt, RequestProcessor
from dmtd.engine.runner import ModelRunner
from dmtd.engine.scheduler import Scheduler
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence, SequenceStatus
from dmtd.engine.step_executor import StepExecutor
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
        self.cfg = cfg = cfg or EngineConfig()
        self.dmtd, self.tokenizer = dmtd, tokenizer
        vocab_size = model.config.vocab_size
        if phrase_table is not None and phrase_table.vocab_size != vocab_size:
            raise ValueError(f"phrase_table: made for a vocabulary of {phrase_table.vocab_size}, the model has "
                             f"{vocab_size}")
        self.runner = ModelRunner(model, dmtd, cfg, verifier)
        # where prompts run as rows, a prompt's bits do not depend on how its prefill is split: the prefix cache
        # shares single pages, and a prompt may be split anywhere while others decode
        self.rows_prefill = self.runner.rows_prefill()
        self.scheduler = Scheduler(dmtd, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                   max_prefill_tokens=cfg.max_prefill_tokens, align_phases=cfg.align_phases,
                                   prefill_chunk=cfg.prefill_chunk, prefix_caching=cfg.prefix_caching,
                                   pages=self.runner.cache.pages, long_prefill_tokens=cfg.long_prefill_tokens,
                                   cache_chunk=self.runner.cache.page_size if self.rows_prefill else None)
        # an exact prompt's drafts' KV the runner deferred past its first token is written before its pages go
        self.scheduler.kv.before_release = self._catch_up_for
        # a finished answer's KV serves the conversation's next turn where a decode row computes a position as a
        # prefill does (prompts as rows on the same kernels; not AMX, whose prompt attention runs on tiles), in the
        # groups its readers read: the trunk and the verifier's for exact sequences, every group where no tail runs
        if self.rows_prefill and lowbit.loaded_path() != "amx":
            self.scheduler.kv.answers = lambda s: s.params.exact or dmtd.tau_max == 1
        self.pacer = PrefillPacer(cfg.prefill_pace)  # how much prompt a step takes while others decode
        self.default_tau = default_tau or dmtd.tau_max
        eos = eos_token_ids if eos_token_ids is not None else list(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(int(tokenizer.eos_token_id))
        self.eos_ids = set(eos)
        self.shaper = LogitsShaper(tokenizer, vocab_size, self.eos_ids)  # penalties, bias, grammars, min_tokens
        # each request's sequence, detokenizer and generator; prompts in, outputs (text, stop strings) out
        self.requests = RequestProcessor(tokenizer, vocab_size, self.eos_ids, self.scheduler, self.shaper,
                                         self.runner.device)
        self.seqs = self.requests.seqs  # request id → its Sequence (read-only)
        self.forks = Forks()  # requests that share a waiting sibling's prefill
        self.timed = PassTimer()
        self.pass_stats = self.timed.stats  # kind -> [calls, seconds] of the model passes (benchmarks)
        self.phrase_table = phrase_table if cfg.phrase_drafts else None  # the variant's, where its drafts are on
        # the exact profile's drafts: chosen, made, checked, counted
        self.cycles = VerifiedCycles(cfg, self.runner, self.scheduler, self.shaper, self.requests, self.timed,
                                     self.phrase_table)
        self.scheduler.on_resume = self.cycles.resumed
        self.executor = StepExecutor(self.runner, self.scheduler, self.cycles, self.requests, self.shaper, self.forks,
                                     self.pacer, self.timed)
        if draft_vocab is not None:
            self.runner.set_draft_vocab(check_draft_vocab(draft_vocab, vocab_size, self.eos_ids))

    @property
    def verifier_name(self) -> str:
        """What verified cycles reproduce: ``base`` (the base model) or ``variant`` (its τ = 1 path)."""
        return self.runner.verifier.name

    @property
    def num_joined_checks(self) -> int:
        """Steps whose drafting exact sequences joined the check most made (``align_checks``)."""
        return self.cycles.num_joined_checks

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule a batch, run its passes, postprocess their tokens into per-request outputs."""
        if self.runner.deferred:  # the drafts' KV of the exact prompts the last step gave a first token
            self.timed("catch_up", lambda _: self.runner.catch_up(), [])
        t_step = time.perf_counter()
        sched = self.scheduler
        plan = sched.schedule(self.pacer.budgets(self.rows_prefill, sched.num_prompts, len(sched.running)))
        self.cycles.preempted(plan.preempted)  # their drafts went with their pages
        if not plan.seqs:
            return []
        return self.executor.execute(plan, t_step)

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: raw ids, text, or chat messages (rendered with the chat template)."""
        return self.requests.encode(prompt)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    req_id: str | None = None, prefill_with: str | None = None, variant: str = "") -> str:
        """Queue a request for a prompt's token ids (:meth:`encode` makes them of text or chat messages).
        ``prefill_with``: a sibling request with the same prompt whose prefill this one shares, if that is still to
        come (dmtd.engine.forks); else it is prefilled on its own. ``variant``: whose tails it runs (one of
        :attr:`variants`; ``""``: the engine's own)."""
        params = params or SamplingParams()
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.seqs:
            raise RequestError("request_id", f"{req_id!r} is already in use")
        if variant and variant not in self.runner.state.tails:
            loaded = ", ".join(self.variants) or "none but the engine's own"
            raise RequestError("variant", f"{variant!r} is not loaded here (loaded: {loaded})")
        tau = params.tau if params.tau is not None else self.default_tau
        seq = Sequence(req_id, self.requests.token_ids(prompt_token_ids), params, tau=tau, variant=variant)
        self.requests.open(seq, params)
        sibling = self.seqs.get(prefill_with) if prefill_with else None
        try:
            if not (sibling is not None and sibling.variant == variant and self.forks.attach(seq, sibling)):
                self.scheduler.add(seq)
        except BaseException:  # refused (a RequestError) or broken: the request leaves nothing behind
            self.requests.forget(req_id)
            raise
        if params.exact:
            self.cycles.enable()
        return req_id

    # -- variants of the trunk ----------------------------------------------------------------------
    @property
    def variants(self) -> list[str]:
        """The other variants served beside the engine's own (:meth:`add_variant`)."""
        return sorted(self.runner.state.tails)

    def add_variant(self, name: str, decoding_layers: list[LayerWeights]) -> int:
        """Serve another variant of this engine's trunk (the same layer split and base weights below the decoding
        group, which ``decoding_layers`` replace, dense in the model's dtype): its sequences share every step, the
        trunk's rows and the prefix cache with the others, their tail path runs its decoding group. Returns the bytes
        its layers hold."""
        if not name or name in self.runner.state.tails:
            raise ConfigError(f"variant {name!r}: a name not loaded yet is needed")
        return self.runner.add_tails(name, decoding_layers)

    def remove_variant(self, name: str) -> None:
        """Stop serving ``name``: its layers are let go. Refused while a request of it is unfinished."""
        if name not in self.runner.state.tails:
            raise ConfigError(f"variant {name!r} is not loaded")
        busy = [rid for rid, s in self.seqs.items() if s.variant == name and not s.finished]
        if busy:
            raise ConfigError(f"variant {name!r} still has {len(busy)} unfinished request(s)")
        self.runner.remove_tails(name)

    def retune(self, req_id: str, tau: int | None = None, min_confidence: float | None = None) -> None:
        """Change a running request's τ and / or its confidence gate (the replica's controller); a new τ takes
        effect at its next head. Unknown or finished requests are left alone."""
        if tau is not None and not 1 <= tau <= self.dmtd.tau_max:
            raise RequestError("tau", f"must be in 1..{self.dmtd.tau_max}, got {tau}")
        if min_confidence is not None and not 0.0 <= min_confidence <= 1.0:  # NaN fails too
            raise RequestError("min_confidence", f"must be in [0, 1], got {min_confidence}")
        seq = self.seqs.get(req_id)
        if seq is None or seq.finished:
            return
        if tau is not None:
            seq.tau = tau
        if min_confidence is not None:
            seq.params.min_confidence = min_confidence

    def abort(self, req_id: str) -> bool:
        """Cancel a request; its cache row is free on return. False if it was unknown or done."""
        seq = self.seqs.get(req_id)
        self.requests.forget(req_id)
        if seq is None or seq.finished:
            return False
        if self.forks.detach(req_id) is not None:  # it waited on a sibling's prefill: in no queue
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            return True
        self.scheduler.finish(seq, "abort")
        for kid in self.forks.orphans(req_id):
            self.scheduler.add(kid)
        return True

    def release(self, req_id: str) -> None:
        """Drop a finished request's bookkeeping."""
        self.requests.forget(req_id)

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

    # -- conveniences ---------------------------------------------------------------------------
    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Run one request alone (plus whatever else is queued) and yield its step outputs."""
        rid = self.add_request(self.encode(prompt), params)
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

    def generate(self, prompts: SequenceT[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 variants: list[str] | None = None) -> list[GenerationResult]:
        """Generate for all prompts together (continuous batching) and return results in order; ``variants``: each
        prompt's variant (:meth:`add_request`)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        vlist = variants or [""] * len(prompts)
        ids = [self.add_request(self.encode(p), sp, variant=v) for p, sp, v in zip(prompts, plist, vlist)]
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
                r.add(o)
                if o.finished:
                    r.decode_time_s = time.perf_counter() - (t0 or time.perf_counter())
                    seq = self.seqs.get(o.req_id)
                    if seq is not None:
                        r.add_drafts(seq.draft)
                    self.release(o.req_id)
        return [res[rid] for rid in ids]
