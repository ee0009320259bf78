"""What the engine keeps per request, in one record: its sequence (scheduler, KV and draft state), its detokenizer (text
and stop strings) and its sampling generator. Dropped in one place (``RequestProcessor.forget``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from dmtd.engine.outputs import Detokenizer
from dmtd.engine.sequence import Sequence


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detok: Detokenizer | None  # None: no tokenizer (token ids in, token ids out)
    gen: torch.Generator | None  # None: greedy


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
