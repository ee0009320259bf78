"""One step's plan carried out (nano-vllm's run and postprocess): the plan's passes on the model runner — prompt
chunks, plain decode steps, the verified cycles' drafts and checks, prompt rows riding on a carrier pass — their tokens
sampled and applied by the scheduler, turned into outputs by the request processor, and the pacer told what the step
cost."""

from __future__ import annotations

import time

import torch

from dmtd.engine.forks import Forks
from dmtd.engine.logits_process import LogitsShaper
from dmtd.engine.outputs import StepOutput
from dmtd.engine.pass_timer import PassTimer
from dmtd.engine.prefill_pacer import PrefillPacer
from dmtd.engine.request_processor import RequestProcessor
from dmtd.engine.runner import ModelRunner
from dmtd.engine.sampler import sample
from dmtd.engine.scheduler import Scheduler, StepPlan
from dmtd.engine.sequence import Sequence
from dmtd.engine.verified import VerifiedCycles


class StepExecutor:
    """Executes :class:`~dmtd.engine.scheduler.StepPlan`\\ s; given its collaborators, it owns no state of its own."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, cycles: VerifiedCycles, requests: RequestProcessor,
                 shaper: LogitsShaper, forks: Forks, pacer: PrefillPacer, timer: PassTimer) -> None:
        self.runner, self.scheduler, self.cycles, self.requests = runner, scheduler, cycles, requests
        self.shaper, self.forks, self.pacer, self.timed = shaper, forks, pacer, timer

    def execute(self, plan: StepPlan, t_step: float) -> list[StepOutput]:
        """Run a planned step that began at ``t_step``; its outputs, one per token emitted (or request failed)."""
        if plan.is_prefill:
            results = self._prefill(plan)
            self.pacer.observe_prefill(plan.prefill_keys, 1e3 * (time.perf_counter() - t_step), plan.paced)
            return results
        carrier = carrier_kind(plan.decode)  # as scheduled, before the cycles assign this step's passes
        results = self._decode(plan, t_step)
        ms = 1e3 * (time.perf_counter() - t_step)
        self.pacer.observe_decode(ms, bool(self.scheduler.num_prompts))
        if carrier is not None:
            self.pacer.observe_carrier(carrier, ms, plan.prefill_keys if plan.ride else 0.0)
        return results

    def _prefill(self, plan: StepPlan) -> list[StepOutput]:
        """A prefill step: each prompt's next chunk; the prompts it finishes sample their first token."""
        done, logits = [], []
        for s in plan.prefill:  # one by one: a prompt's chunks are published before the next one's run
            self.scheduler.reuse(s)
            logits.append(self.timed("prefill", self.runner.prefill, [s])[0])
            done += self.scheduler.prefilled([s])
        return self._first_tokens(done, logits)

    def _first_tokens(self, done: list[Sequence], logits: list[torch.Tensor]) -> list[StepOutput]:
        """The prompts a step completed (``done``, their last positions' logits in ``logits``) sample their first
        token (and their forks theirs)."""
        if not done:
            return []
        if self.forks.waiting:  # siblings copy the prompt's KV: all of it
            self.runner.catch_up()
        plan, rows = self.forks.fork(StepPlan(prefill=done), torch.cat(logits), self.scheduler, self.runner.cache)
        results = self._sampled(plan, rows)
        conf = {o.req_id: o.confidence for o in results}
        for s in plan.prefill:
            if s.params.exact:
                self.cycles.after_prefill(s, conf.get(s.req_id, 1.0))
        return results

    def _decode(self, plan: StepPlan, t_step: float) -> list[StepOutput]:
        """A decode step: plain sequences, sequences drafting and sequences checking, each kind in one pass. A step
        of one kind costs the draft policy its whole wall time (the pass, picking or checking the tokens, the step's
        own bookkeeping): each draft is a step of its own, and a policy that counted the pass alone drafted where the
        steps' ~5 % more made a second draft not pay."""
        self.cycles.assign(plan)
        plain, drafting, checking = plan.plain, plan.drafting, plan.checking
        riders: list[Sequence] = []  # prompt chunks riding on the check or the head step (the scheduler's plan.ride)
        for s in plan.ride:
            self.scheduler.reuse(s)
            if s.num_prefilled < s.prefill_end:
                riders.append(s)
        prompt_logits = None
        # with no check pass, unverified prompts ride on the plain sequences' pass (the scheduler's "head" carrier)
        on_plain = riders if plain and not checking and not any(s.params.exact for s in riders) else []
        results: list[StepOutput] = []
        if plain:
            logits = self.timed("decode", lambda seqs: self.runner.decode(seqs, on_plain), plain)[0]
            prompt_logits = self.runner.prompt_logits if on_plain else None
            results = self._sampled(StepPlan(decode=plain), logits, False)
        if drafting:
            results += self.cycles.draft(drafting, t_step if not (plain or checking) else None)
        if checking:
            results += self.cycles.check(checking, t_step if not (plain or drafting) else None, riders)
            prompt_logits = self.runner.prompt_logits if riders else None
        elif riders and not on_plain:  # should no pass carry them, they get their own
            prompt_logits = self.timed("prefill", self.runner.prefill, riders)[0]
        self.scheduler.num_decode_steps += 1
        self.cycles.observe_step(plan, len(results), time.perf_counter() - t_step, bool(riders))
        done = self.scheduler.prefilled(plan.ride) if plan.ride else []
        if done:
            assert prompt_logits is not None and len(prompt_logits) == len(done)
            results += self._first_tokens(done, [prompt_logits])
        return results

    def _sampled(self, plan: StepPlan, logits: torch.Tensor, advance_clock: bool = True) -> list[StepOutput]:
        """Sample one token per sequence of a prefill or plain decode batch, then apply the step."""
        seqs = plan.seqs
        logits = self.shaper.rows(logits, seqs)
        tokens, confs, finite = sample(logits, [s.params for s in seqs],
                                       [self.requests.generator(s.req_id) for s in seqs])
        for i, s in enumerate(seqs):
            self.shaper.record(s.req_id, s.params, logits[i: i + 1], tokens[i: i + 1])
        results = self.requests.fail([s for s, ok in zip(seqs, finite) if not ok])
        if len(results):
            keep = [i for i, ok in enumerate(finite) if ok]
            plan = StepPlan(prefill=[seqs[i] for i in keep] if plan.is_prefill else [],
                            decode=[] if plan.is_prefill else [seqs[i] for i in keep])
            tokens, confs = [tokens[i] for i in keep], [confs[i] for i in keep]
        for ev in self.scheduler.postprocess(plan, tokens, confs, self.requests.eos_ids, advance_clock):
            results.append(self.requests.to_output(ev))
        return results


def carrier_kind(seqs: list[Sequence]) -> str | None:
    """Which carrier (:data:`~dmtd.engine.prefill_pacer.CARRIERS`) a decode step of ``seqs`` is, for the pacer's
    timing: a check pass, a step of unverified sequences where some reach their heads, or neither."""
    if any(s.checks_next for s in seqs):
        return "check"
    if not any(s.params.exact for s in seqs) and any(s.next_is_head for s in seqs):
        return "head"
    return None
