"""What the engine hands back: per-step token events, whole results, and the incremental detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass(slots=True)
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

    @property
    def acceptance(self) -> float | None:
        """Accepted ÷ drafted tokens (verified cycles, tail and context drafts); None when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_block_len(self) -> float:
        return sum(map(len, self.blocks)) / len(self.blocks) if self.blocks else 0.0
