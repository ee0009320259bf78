"""What the engine hands back: per-step token events, whole results, and the incremental detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dmtd.engine.draft_state import DraftState

# one emitted token's log-probability: (token id, its bytes, log p, the most likely tokens as (id, bytes, log p))
TokenLogprob = tuple[int, bytes, float, list[tuple[int, bytes, float]]]


class Detokenizer:
    """Incremental, UTF-8-safe detokenization (holds back a trailing partial character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


@dataclass(slots=True, kw_only=True)
class StepOutput:
    """What one step did for one request (``block`` set when a cycle completed)."""

    req_id: str
    token_id: int
    is_head: bool
    confidence: float
    text_delta: str
    block: list[int] | None = None
    block_confidences: list[float] | None = None
    tau: int = 1
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_drafted: int = 0  # verified cycles: drafts checked by the head that closed this block
    num_accepted: int = 0
    num_context_drafted: int = 0  # of them, drafts not from the tails (prompt lookup, the phrase table)
    num_context_accepted: int = 0
    logprob: TokenLogprob | None = None  # with SamplingParams.logprobs: this token's (dmtd.engine.logits_process)


@dataclass(slots=True)
class GenerationResult:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    blocks: list[list[int]] = field(default_factory=list)
    head_flags: list[bool] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    decode_time_s: float = 0.0
    error: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_by_pos: list[int] = field(default_factory=list)
    drafted_by_pos: list[int] = field(default_factory=list)
    num_context_drafted: int = 0
    num_context_accepted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, o: StepOutput) -> None:
        """Fold one of the request's step outputs in."""
        if o.token_id >= 0:
            self.token_ids.append(o.token_id)
            self.head_flags.append(o.is_head)
            self.confidences.append(o.confidence)
        self.text += o.text_delta
        if o.logprob is not None:
            self.logprobs.append(o.logprob)
        if o.block:
            self.blocks.append(o.block)
        if o.finished:
            self.finish_reason, self.error = o.finish_reason, o.error

    def add_drafts(self, draft: DraftState) -> None:
        """The finished request's verified cycles, counted (drafted and accepted, by source and by position)."""
        self.num_drafted, self.num_accepted = draft.num_drafted, draft.num_accepted
        self.num_context_drafted, self.num_context_accepted = draft.num_context_drafted, draft.num_context_accepted
        self.drafted_by_pos, self.accepted_by_pos = list(draft.drafted_by_pos), list(draft.accepted_by_pos)

    @property
    def acceptance(self) -> float | None:
        """Accepted ÷ drafted tokens (verified cycles, tail and context drafts); None when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_block_len(self) -> float:
        return sum(map(len, self.blocks)) / len(self.blocks) if self.blocks else 0.0
