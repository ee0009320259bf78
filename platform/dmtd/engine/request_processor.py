"""Requests in and outputs out, at the engine's edge (as vLLM's input and output processors): prompts to token ids
(text, chat messages or ids), each request's record (its sequence, detokenizer and sampling generator), and token
events to step outputs — the text delta, stop strings (which end the request), the logprob."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dmtd.engine.logits_process import LogitsShaper
from dmtd.engine.outputs import Detokenizer, StepOutput
from dmtd.engine.requests import RequestState, SequenceView
from dmtd.engine.scheduler import Scheduler, TokenEvent
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence

Prompt = str | list[int] | list[dict[str, str]]


class RequestProcessor:
    """Owns the per-request records (``requests``; ``seqs``: request id → its sequence, read-only)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int], scheduler: Scheduler,
                 shaper: LogitsShaper, device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.scheduler, self.shaper, self.device = scheduler, shaper, device
        self.requests: dict[str, RequestState] = {}
        self.seqs = SequenceView(self.requests)

    @property
    def serves_chat(self) -> bool:
        """Whether the tokenizer renders chat messages (a base model's often has no chat template)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: raw ids, text, or chat messages (rendered with the chat template). A prompt that
        cannot be is refused (:class:`RequestError` naming ``prompt``, ``messages`` or ``prompt_token_ids``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "must not be empty")
            return self._tokenise("prompt", lambda: self.tokenizer.encode(prompt, add_special_tokens=False))
        if prompt and isinstance(prompt[0], dict):
            if not self.serves_chat:
                raise RequestError("messages", "this model has no chat template, so it serves completions only "
                                               "(send a prompt)")
            out = self._tokenise("messages", lambda: self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True))
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return self.token_ids(prompt)  # type: ignore[arg-type]

    def token_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """A prompt's token ids, checked against the vocabulary (the engine takes nothing else)."""
        if isinstance(prompt_token_ids, str) or (prompt_token_ids and isinstance(prompt_token_ids[0], dict)):
            raise TypeError("a request's prompt is token ids here: encode() makes them of text or chat messages")
        ids = [int(t) for t in prompt_token_ids]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestError("prompt_token_ids", f"token ids must be in 0..{self.vocab_size - 1}")
        return ids

    @staticmethod
    def _tokenise(field: str, run: Callable[[], Any]) -> Any:
        """The tokenizer's result; the input's fault (text it cannot take) is a :class:`RequestError`."""
        try:
            return run()
        except (ValueError, TypeError, UnicodeError, KeyError, IndexError) as e:
            raise RequestError(field, f"cannot be tokenised ({type(e).__name__}: {e})"[:300]) from e

    def open(self, seq: Sequence, params: SamplingParams) -> None:
        """The record of a new request: its generator (seeded before anything is queued: a seed torch refuses leaves
        no trace), its detokenizer, its logits shaping."""
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.shaper.add(seq.req_id, params)
        self.requests[seq.req_id] = RequestState(seq, detok, gen)

    def generator(self, req_id: str) -> torch.Generator | None:
        """A request's sampling generator (None: greedy)."""
        return self.requests[req_id].gen

    def fail(self, seqs: list[Sequence]) -> list[StepOutput]:
        """End requests whose logits were not finite; their error outputs."""
        results = []
        for s in seqs:
            self.scheduler.finish(s, "error", "the model produced non-finite logits")
            results.append(StepOutput(req_id=s.req_id, token_id=-1, is_head=s.next_is_head, confidence=math.nan,
                                      text_delta="", block=s.block.tokens or None, block_confidences=None,
                                      tau=s.tau, finished=True, finish_reason="error", error=s.error))
            self.forget(s.req_id)
        return results

    def to_output(self, ev: TokenEvent) -> StepOutput:
        """A token event as the request's output: its text delta (stop strings end the request), its logprob."""
        req = self.requests[ev.req_id]
        seq, det = req.seq, req.detok
        delta = ""
        if det is not None and ev.token_id >= 0 and not (ev.finish_reason == "stop" and ev.token_id in self.eos_ids):
            delta = det.push(ev.token_id)
            # no stop string ends the output before min_tokens (vLLM's): the tokens pushed so far, this one included
            hit = find_stop(det.text, seq.params.stop, len(delta)) if len(det.ids) >= seq.params.min_tokens else None
            if hit is not None:
                cut = len(det.text) - hit
                delta = delta[: len(delta) - cut] if cut <= len(delta) else ""
                det.text = det.text[:hit]
                if not ev.finished:
                    self.scheduler.finish(seq, "stop")
                    ev.finished, ev.finish_reason = True, "stop"
                    if ev.block is None:
                        ev.block, ev.block_confidences = seq.block.take()
        res = StepOutput(req_id=ev.req_id, token_id=ev.token_id, is_head=ev.is_head, confidence=ev.confidence,
                         text_delta=delta, block=ev.block, block_confidences=ev.block_confidences, tau=seq.tau,
                         finished=ev.finished, finish_reason=ev.finish_reason)
        lp = self.shaper.emitted(ev.req_id, ev.token_id)
        if not (ev.finish_reason == "stop" and ev.token_id in self.eos_ids):  # an EOS that ends the text is no text
            res.logprob = lp
        if ev.finished:
            self.forget(ev.req_id, keep_seq=True)
        return res

    def forget(self, req_id: str, keep_seq: bool = False) -> None:
        """Drop a request's per-request state (all of it, or all but its sequence and text: a finished request's
        result is read after its last output)."""
        self.shaper.drop(req_id)
        if not keep_seq:
            self.requests.pop(req_id, None)
        elif req_id in self.requests:
            self.requests[req_id].gen = None  # (a finished sequence's drafts were checked or cleared: no q is left)


def find_stop(text: str, stops: list[str], delta_len: int) -> int | None:
    """Where the earliest stop string in ``text`` begins, looking only where the last ``delta_len`` characters could
    have completed one; None if none."""
    if not stops:
        return None
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - delta_len - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
