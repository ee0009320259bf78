"""Per-request state: sampling parameters and the sequence bookkeeping (torch-free)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum

from dmtd.engine.draft_state import CONTEXT_NGRAMS, DraftState
from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT

__all__ = ["CONTEXT_NGRAMS", "CycleBlock", "RequestError", "SamplingParams", "Sequence", "SequenceCounts",
           "SequenceStatus"]


class RequestError(ValueError):
    """A request breaks a rule; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.rule = field, message


MAX_TOP_LOGPROBS = 20
TEMPERATURE_FLOOR = 1e-2  # below it logits / T overflow float32 (1e-37 gave garbage): such temperatures are greedy


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings. ``temperature`` below ``TEMPERATURE_FLOOR`` (0 included) is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = MAX_NEW_TOKENS_DEFAULT
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output before this many tokens (vLLM's)
    tau: int | None = None  # τ; None = the variant's default
    min_confidence: float = 0.0  # the gate; with ``exact`` it only stops drafting
    exact: bool = False  # verified cycles: tails are drafts the next head checks; output = the verifier's
    # the request's shaping of the logits its tokens are drawn from (dmtd.engine.logits_process)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # llguidance's JSON form of a grammar the output must match (dmtd.engine.grammar)
    logprobs: int | None = None  # each emitted token's log-probability and this many most likely ones (0..20)

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise RequestError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError("min_tokens", f"must be in 0..max_new_tokens ({self.max_new_tokens}), got "
                               f"{self.min_tokens}")
        if self.tau is not None and self.tau < 1:
            raise RequestError("tau", f"must be >= 1, got {self.tau}")
        if not (0.0 <= self.min_confidence <= 1.0):
            raise RequestError("min_confidence", f"must be in [0, 1], got {self.min_confidence}")
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise RequestError(name, f"must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise RequestError("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for b in self.logit_bias.values()):
            raise RequestError("logit_bias", "biases must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(slots=True)
class CycleBlock:
    """The tokens (and their confidences) of the cycle under way, emitted together when it closes."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)

    def append(self, token: int, confidence: float) -> None:
        self.tokens.append(token)
        self.confidences.append(confidence)

    def take(self) -> tuple[list[int], list[float]]:
        """The block's tokens and confidences; the block starts empty again."""
        out = self.tokens, self.confidences
        self.tokens, self.confidences = [], []
        return out


@dataclass(slots=True)
class SequenceCounts:
    """What a sequence's steps did, counted (heads run, cycles cut short by the confidence gate, preemptions)."""

    num_heads: int = 0
    num_cycles_cut: int = 0
    num_preempted: int = 0  # times its KV pages were taken back and it was queued to be prefilled again


@dataclass(slots=True)
class Sequence:
    """One request inside the engine.

    Positions: the token at index ``i`` sits at position ``i``. A step feeds the last token (position
    ``num_tokens - 1``); it is a head iff that position equals ``next_head_pos``. The thinking group
    holds KV for positions ``< num_think_cached``; the tail positions in between wait for refill.
    Verified cycles keep their drafts in ``draft`` (:class:`~dmtd.engine.draft_state.DraftState`).
    """

    req_id: str
    token_ids: list[int]
    params: SamplingParams
    tau: int
    variant: str = ""  # whose tails its tail path runs (dmtd.engine.model_state.ModelState.tails); "": the engine's own
    prompt_len: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    kv_row: int = -1  # its row of the KV cache's page table (dmtd.engine.kv_manager); -1: none
    num_think_cached: int = 0
    next_head_pos: int = 0
    block: CycleBlock = field(default_factory=CycleBlock)
    counts: SequenceCounts = field(default_factory=SequenceCounts)
    num_tail_cached: int = 0  # the tail path's decoding-group KV holds positions < this
    num_prefilled: int = 0  # prompt positions whose KV is in its pages (chunked prefill)
    prefill_end: int = 0  # the current prefill step computes positions num_prefilled .. prefill_end - 1
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache, not computed
    prefix_keys: list[bytes] = field(default_factory=list)  # the prompt's whole chunks' keys (prefix cache)
    # after a preemption: the positions to compute again before it decodes on (all but the last token's, which the
    # next step feeds as it would have); 0: none (a fresh prompt is prefilled to its end)
    resume_len: int = 0
    # generated positions fed as tails (DMTD profile): a resume after a preemption routes them as tails again
    tail_positions: set[int] = field(default_factory=set)
    draft: DraftState = field(default_factory=DraftState)  # verified cycles: written by dmtd.engine.verified
    finish_reason: str | None = None
    error: str | None = None
    seq_no: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def position(self) -> int:
        """Position of the token the next decode step feeds."""
        return len(self.token_ids) - 1

    @property
    def num_preempted(self) -> int:
        return self.counts.num_preempted

    @property
    def next_is_head(self) -> bool:
        return self.position == self.next_head_pos

    @property
    def num_to_refill(self) -> int:
        """Tail positions whose thinking-layer KV awaits refill."""
        return self.position - self.num_think_cached

    @property
    def draft_position(self) -> int:
        """Position the next draft step feeds (verified cycles)."""
        return len(self.token_ids) - 1 + len(self.draft.tokens)

    @property
    def checks_next(self) -> bool:
        """Whether its next decode step is a verified cycle's check (its drafts are done)."""
        return self.params.exact and self.draft.done

    def stops_at(self, tok: int, eos_ids: set[int]) -> bool:
        """Whether ``tok`` ends this request: one of its stop tokens, or an EOS id unless it ignores EOS."""
        return tok in self.params.stop_token_ids or (not self.params.ignore_eos and tok in eos_ids)

    def draft_room(self, max_model_len: int) -> int:
        """Drafts a cycle may check, whoever makes them: τ − 1, bounded so the check fits the budget and the context."""
        left = self.params.max_new_tokens - self.num_generated
        return max(0, min(self.tau - 1, left - 1, max_model_len - len(self.token_ids)))

    def max_drafts(self, max_model_len: int) -> int:
        """Tail drafts worth making this cycle: :meth:`draft_room`, at most the policy's ``draft.target``."""
        room = self.draft_room(max_model_len)
        return room if self.draft.target is None else min(room, self.draft.target)

    def context_continuation(self, k: int, n: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last ``n`` tokens (prompt
        and answer so far; :meth:`DraftState.context_continuation`)."""
        return self.draft.context_continuation(self.token_ids, k, n)

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
