"""Per-request state: sampling parameters and the sequence bookkeeping (torch-free)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum


class RequestError(ValueError):
    """A request breaks a rule; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# context drafts match the context's last 3 or 2 tokens (on the demo's chat prompts, τ = 1 answers, up to 4 drafts:
# 3 tokens matched 60 times in 735 tokens, 140 of 240 drafts right; 3 else 2: 90 matches, 169 of 360 right)
CONTEXT_NGRAMS = (3, 2)

MAX_TOP_LOGPROBS = 20
TEMPERATURE_FLOOR = 1e-2  # below it logits / T overflow float32 (1e-37 gave garbage): such temperatures are greedy


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings. ``temperature`` below ``TEMPERATURE_FLOOR`` (0 included) is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
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
class Sequence:
    """One request inside the engine.

    Positions: the token at index ``i`` sits at position ``i``. A step feeds the last token (position
    ``num_tokens - 1``); it is a head iff that position equals ``next_head_pos``. The thinking group
    holds KV for positions ``< num_think_cached``; the tail positions in between wait for refill.
    """

    req_id: str
    token_ids: list[int]
    params: SamplingParams
    tau: int
    prompt_len: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    kv_row: int = -1  # its row of the KV cache's page table (dmtd.engine.kv_manager); -1: none
    num_think_cached: int = 0
    next_head_pos: int = 0
    block: list[int] = field(default_factory=list)
    block_confidences: list[float] = field(default_factory=list)
    num_heads: int = 0
    num_tails: int = 0
    num_cycles_cut: int = 0
    # verified cycles (``params.exact``): unchecked tail tokens, and the tail path's KV extent
    drafts: list[int] = field(default_factory=list)
    draft_done: bool = False  # the drafts await the next head's check
    context_vocab: set[int] = field(default_factory=set)  # context ids outside the draft vocabulary (runner.draft)
    context_vocab_seen: int = 0  # token_ids looked at for them so far
    num_tail_cached: int = 0  # the tail path's decoding-group KV holds positions < this
    num_prefilled: int = 0  # prompt positions whose KV is in its pages (chunked prefill)
    prefill_end: int = 0  # the current prefill step computes positions num_prefilled .. prefill_end - 1
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache, not computed
    prefix_keys: list[bytes] = field(default_factory=list)  # the prompt's whole chunks' keys (prefix cache)
    queued_at: int = 0  # the scheduler's schedule() count when it was admitted (its prefill order ages from it)
    num_preempted: int = 0  # times its KV pages were taken back and it was queued to be prefilled again
    # after a preemption: the positions to compute again before it decodes on (all but the last token's, which the
    # next step feeds as it would have); 0: none (a fresh prompt is prefilled to its end)
    resume_len: int = 0
    # generated positions fed as tails (DMTD profile): a resume after a preemption routes them as tails again
    tail_positions: set[int] = field(default_factory=set)
    num_drafted: int = 0
    num_accepted: int = 0
    draft_target: int | None = None  # this cycle's draft count chosen by the engine's policy (None: τ − 1)
    drafted_by_pos: list[int] = field(default_factory=list)  # per tail position within a cycle
    accepted_by_pos: list[int] = field(default_factory=list)
    # the source of each of this cycle's drafts (dmtd.engine.draft_sources: the tails, prompt lookup, the phrase
    # table, a grammar's forced tokens), one name per draft
    draft_sources: list[str] = field(default_factory=list)
    num_context_drafted: int = 0  # every draft not from the tails (prompt lookup, the phrase table, forced tokens)
    num_context_accepted: int = 0
    context_by_pos: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # source → (drafted, accepted)
    ngram_ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram → index of its latest last token
    ngram_indexed: int = 0  # the n-grams ending before this index are in ngram_ends
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
    def next_is_head(self) -> bool:
        return self.position == self.next_head_pos

    @property
    def num_to_refill(self) -> int:
        """Tail positions whose thinking-layer KV awaits refill."""
        return self.position - self.num_think_cached

    @property
    def draft_position(self) -> int:
        """Position the next draft step feeds (verified cycles)."""
        return len(self.token_ids) - 1 + len(self.drafts)

    def add_drafts(self, tokens: list[int], source: str) -> None:
        """Append drafts proposed by ``source`` (dmtd.engine.draft_sources)."""
        self.drafts += tokens
        self.draft_sources += [source] * len(tokens)

    def trim_drafts(self, m: int) -> None:
        """Keep the first ``m`` drafts."""
        del self.drafts[m:], self.draft_sources[m:]

    def clear_drafts(self) -> None:
        """A new cycle: no drafts yet, drafting not done."""
        self.drafts, self.draft_sources, self.draft_done = [], [], False

    def stops_at(self, tok: int, eos_ids: set[int]) -> bool:
        """Whether ``tok`` ends this request: one of its stop tokens, or an EOS id unless it ignores EOS."""
        return tok in self.params.stop_token_ids or (not self.params.ignore_eos and tok in eos_ids)

    def draft_room(self, max_model_len: int) -> int:
        """Drafts a cycle may check, whoever makes them: τ − 1, bounded so the check fits the budget and the context."""
        left = self.params.max_new_tokens - self.num_generated
        return max(0, min(self.tau - 1, left - 1, max_model_len - len(self.token_ids)))

    def max_drafts(self, max_model_len: int) -> int:
        """Tail drafts worth making this cycle: :meth:`draft_room`, at most the policy's ``draft_target``."""
        room = self.draft_room(max_model_len)
        return room if self.draft_target is None else min(room, self.draft_target)

    def context_continuation(self, k: int, n: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last ``n`` tokens (prompt
        and answer so far; ``n`` in CONTEXT_NGRAMS), or none. The index grows with the context: O(1) a call."""
        ids = self.token_ids
        last = len(ids) - 1  # the n-grams ending before the last token: the suffix itself is not its own match
        for e in range(self.ngram_indexed, last):
            for m in CONTEXT_NGRAMS:
                if e >= m - 1:
                    self.ngram_ends[tuple(ids[e - m + 1: e + 1])] = e
        self.ngram_indexed = max(self.ngram_indexed, last)
        end = self.ngram_ends.get(tuple(ids[-n:])) if k > 0 and len(ids) >= n else None
        return [] if end is None else ids[end + 1: end + 1 + k]

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
