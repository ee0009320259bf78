"""Deterministic data order and padded training batches with head masks, loss masks and per-sequence τ.

Everything a micro-batch holds is a pure function of (seed, micro-batch index): resuming at step ``s``
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmtd.engine.config import DMTDConfig
from dmtd.train.corpus import Record
from dmtd.train.routing import head_flags

MEGA = 16  # micro-batches per length-sorted group: similar lengths share a batch, order stays random


@dataclass(slots=True)
class Batch:
    """A padded micro-batch. Position ``i`` predicts token ``i+1``; ``loss_mask`` marks continuation targets."""

    input_ids: torch.Tensor  # [B, T] long
    head_mask: torch.Tensor  # [B, T] bool
    loss_mask: torch.Tensor  # [B, T] bool
    targets: torch.Tensor  # [B, T] long (next token; 0 where masked)
    taus: list[int]
    lengths: list[int]

    def to(self, device: torch.device) -> Batch:
        if self.input_ids.device == device:
            return self
        return Batch(self.input_ids.to(device), self.head_mask.to(device), self.loss_mask.to(device),
                     self.targets.to(device), self.taus, self.lengths)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class DataOrder:
    """Epoch-wise shuffles of the training records, grouped by length, cut into micro-batches."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        if not lengths:
            raise ValueError("no training records")
        self.lengths, self.batch_size, self.seed = lengths, batch_size, seed
        self._epoch: int | None = None
        self._batches: list[list[int]] = []

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        group = self.batch_size * MEGA
        batches = []
        for a in range(0, len(perm), group):
            chunk = sorted(perm[a: a + group], key=lambda i: (self.lengths[i], i))
            mb = [chunk[b: b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
            order = torch.randperm(len(mb), generator=g).tolist()
            batches += [mb[o] for o in order]
        return batches

    def micro_batch(self, index: int) -> list[int]:
        """Record indices of global micro-batch ``index`` (epochs continue seamlessly)."""
        epoch, k = divmod(index, self.batches_per_epoch)
        if self._epoch != epoch:
            self._epoch, self._batches = epoch, self._epoch_batches(epoch)
        return self._batches[k]


def draw_routing(seed: int, index: int, n: int, tau_min: int, tau_max: int,
                 phase_jitter: bool) -> tuple[list[int], list[int]]:
    """Per-sequence cycle lengths (uniform on ``tau_min..tau_max``) and first-cycle lengths (uniform on
    ``1..τ`` with ``phase_jitter``, else τ) for micro-batch ``index``."""
    g = torch.Generator().manual_seed(seed * 104729 + index + 1)
    taus = torch.randint(tau_min, tau_max + 1, (n,), generator=g).tolist()
    u = torch.rand(n, generator=g).tolist()
    firsts = [1 + int(x * t) if phase_jitter else t for x, t in zip(u, taus)]
    return taus, firsts


def make_batch(records: list[Record], taus: list[int], dmtd: DMTDConfig, max_len: int,
               first_cycles: list[int] | None = None) -> Batch:
    """Pad prompt + continuation (truncated to ``max_len``) and mark heads and loss positions."""
    seqs = [(r.prompt_ids + r.completion_ids)[:max_len] for r in records]
    T = max(len(s) for s in seqs)
    B = len(seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    heads = torch.zeros(B, T, dtype=torch.bool)
    loss = torch.zeros(B, T, dtype=torch.bool)
    targets = torch.zeros(B, T, dtype=torch.long)
    for b, (r, s, tau) in enumerate(zip(records, seqs, taus)):
        n, p = len(s), min(len(r.prompt_ids), len(s))
        ids[b, :n] = torch.tensor(s)
        heads[b, :n] = torch.tensor(head_flags(dmtd, p, n, tau, first_cycles[b] if first_cycles else None))
        targets[b, : n - 1] = ids[b, 1:n]
        loss[b, p - 1: n - 1] = True
    return Batch(ids, heads, loss, targets, list(taus), [len(s) for s in seqs])
