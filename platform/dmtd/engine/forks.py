"""Sequences that share a prompt (the OpenAI API's ``n``): one prefill, its KV copied to each sibling's cache row.

A request added with ``prefill_with`` naming a sibling that is still waiting, with the same prompt and the same
verifying path, waits beside it instead of in the queue. When the sibling's prefill step runs, each such request
takes a cache row of its own (or, with none free, goes to the queue and prefills itself), the prompt's rows of every KV
buffer are copied into it, and it samples its first token from the sibling's last-position logits with its own
generator: from then on it is a sequence like any other. A prompt's KV has the same bits whichever cache row holds it
(the runner prefills one prompt at a time), so a copy decodes exactly as its own prefill would have.
"""

from __future__ import annotations

import torch

from dmtd.engine.kv_cache import KVCache
from dmtd.engine.scheduler import Scheduler, StepPlan
from dmtd.engine.sequence import Sequence, SequenceStatus


class Forks:
    """Requests waiting on a sibling's prefill: sibling id → their sequences."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Sequence]] = {}

    def attach(self, seq: Sequence, sibling: Sequence | None) -> bool:
        """Wait on ``sibling``'s prefill, if it is still to come and shares the prompt and the verifying path."""
        if (sibling is None or sibling.status is not SequenceStatus.WAITING or sibling.token_ids != seq.token_ids
                or sibling.params.exact != seq.params.exact or sibling.req_id in self.waiting_ids()):
            return False
        self.waiting.setdefault(sibling.req_id, []).append(seq)
        return True

    def waiting_ids(self) -> set[str]:
        return {s.req_id for kids in self.waiting.values() for s in kids}

    def detach(self, req_id: str) -> Sequence | None:
        """Forget a waiting request (aborted): its sequence, or None if it waits on nothing."""
        for kids in self.waiting.values():
            for s in kids:
                if s.req_id == req_id:
                    kids.remove(s)
                    return s
        return None

    def orphans(self, sibling_id: str) -> list[Sequence]:
        """The requests that waited on a sibling that will not be prefilled (aborted): they queue on their own."""
        return self.waiting.pop(sibling_id, [])

    def fork(self, out: StepPlan, logits: torch.Tensor, scheduler: Scheduler,
             cache: KVCache) -> tuple[StepPlan, torch.Tensor]:
        """After a prefill pass: the prefilled prompts' waiting siblings join the batch as if prefilled with it."""
        if not self.waiting:
            return out, logits
        rows: list[int] = []
        for i, s in enumerate(list(out.prefill)):
            for kid in self.waiting.pop(s.req_id, []):
                if scheduler.admit_prefilled(kid):
                    copy_prompt_kv(cache, s.kv_row, kid.kv_row, s.num_tokens)
                    out.prefill.append(kid)
                    rows.append(i)
                else:
                    scheduler.add(kid)
        if rows:
            logits = torch.cat([logits, logits[torch.tensor(rows, device=logits.device)]])
        return out, logits


def copy_prompt_kv(cache: KVCache, src: int, dst: int, length: int) -> None:
    """Cache row ``src``'s first ``length`` positions into row ``dst``'s pages, in every buffer that holds positions."""
    cache.copy_rows(src, dst, length)
    cache.tail_enc[dst] = cache.tail_enc[src]
