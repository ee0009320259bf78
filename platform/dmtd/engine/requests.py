"""What the engine keeps per request, in one record: its sequence (scheduler and KV state), its detokenizer (text and
stop strings), its sampling generator and the q of its pending drafts (sampled verified cycles). Dropped in one place
(``LLMEngine._forget``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from dmtd.engine.outputs import Detokenizer
from dmtd.engine.sequence import Sequence


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detok: Detokenizer | None  # None: no tokenizer (token ids in, token ids out)
    gen: torch.Generator | None  # None: greedy
    draft_q: list[torch.Tensor | None] = field(default_factory=list)  # the tail's distribution of each pending draft


class SequenceView(Mapping[str, Sequence]):
    """Request id → its :class:`Sequence`, read-only, over the engine's records."""

    def __init__(self, requests: dict[str, RequestState]) -> None:
        self._requests = requests

    def __getitem__(self, req_id: str) -> Sequence:
        return self._requests[req_id].seq

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)
