"""The paged KV cache: one pool of pages per layer, a page table per cache row (one running sequence a row)."""

from __future__ import annotations

import torch

from dmtd.engine.config import DMTDConfig, ModelConfig
from dmtd.engine.kv_pages import KVPages, pages_for


def bytes_per_position(model: ModelConfig, dmtd: DMTDConfig, kv_dtype: torch.dtype, hidden_dtype: torch.dtype) -> int:
    """What one position of the pool costs with verified cycles on: every layer's K and V, the verifier's decoding
    group's, and the tail path's stashed decoding input."""
    kv = 2 * model.num_kv_heads * model.head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    stash = model.hidden_size * torch.empty(0, dtype=hidden_dtype).element_size()
    return kv * (model.num_layers + dmtd.num_decoding_layers) + stash


class KVCache:
    """Pages ``[num_pages, num_kv_heads, page_size, head_dim]`` of K and V for every layer, and the table
    ``[num_rows, max_model_len / page_size]`` of each row's pages (:mod:`dmtd.engine.kv_pages` decides them).

    Layers are grouped as the variant splits them (encoding / thinking / decoding); the groups fill at
    different speeds — the thinking group lags the others by the tails that await refill — so their
    lengths are tracked per sequence by the scheduler; a position's page is the same in every group.
    ``tail_enc`` holds the encoding-group output of those tail positions (the thinking group's input at the
    next head), a few rows per cache row.
    """

    def __init__(self, model: ModelConfig, dmtd: DMTDConfig, num_rows: int, max_len: int, pages: KVPages,
                 dtype: torch.dtype, device: torch.device | str, hidden_dtype: torch.dtype | None = None) -> None:
        hidden_dtype = hidden_dtype or dtype  # of ``tail_enc`` and ``stash`` (activations; KV may be wider)
        self.pages = pages
        P = pages.page_size
        shape = (pages.num_pages, model.num_kv_heads, P, model.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.groups = {
            "encoding": range(0, dmtd.thinking_start),
            "thinking": range(dmtd.thinking_start, dmtd.decoding_start),
            "decoding": range(dmtd.decoding_start, dmtd.num_layers),
        }
        self.tail_enc = torch.zeros(num_rows, max(dmtd.tau_max, 1), model.hidden_size, dtype=hidden_dtype,
                                   device=device)
        # unassigned entries name page 0: only masked keys are ever read through them
        self.table = torch.zeros(num_rows, pages_for(max_len, P), dtype=torch.long, device=device)
        self.num_rows, self.max_len, self.page_size = num_rows, max_len, P
        self._spec = (model, dmtd, dtype, device, hidden_dtype)
        self.verify_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.stash: torch.Tensor | None = None

    def enable_verify(self) -> None:
        """Buffers of verified cycles, made on first use.

        ``verify_layers``: the verifying path's decoding-group KV, beside the tail path's (``layers``), so
        heads attend to verifier keys and values at every position while tails keep their own. ``stash``:
        the tail path's head-routed decoding input at checked positions, consumed by the next draft step.
        """
        if self.verify_layers is not None:
            return
        model, dmtd, dtype, device, hidden_dtype = self._spec
        shape = self.layers[0][0].shape
        self.verify_layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(dmtd.num_decoding_layers)
        ]
        self.stash = torch.zeros(self.pages.num_pages, self.page_size, model.hidden_size, dtype=hidden_dtype,
                                 device=device)

    def sync(self) -> None:
        """Copy the rows whose page lists changed into the table the kernels read."""
        for row in self.pages.take_dirty():
            pages = self.pages.tables[row]
            self.table[row].zero_()
            if pages:
                self.table[row, : len(pages)] = torch.tensor(pages, dtype=torch.long)

    def where(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The page and the offset in it of each (row, position)."""
        return self.table[rows, positions // self.page_size], positions % self.page_size

    def stash_read(self, row: int, start: int, end: int) -> torch.Tensor:
        """The stashed decoding input of ``row``'s positions ``start .. end - 1`` [end - start, H]."""
        assert self.stash is not None
        pos = torch.arange(start, end, device=self.table.device)
        return self.stash[self.table[row, pos // self.page_size], pos % self.page_size]

    def stash_write(self, rows: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
        assert self.stash is not None
        page, off = self.where(rows, positions)
        self.stash[page, off] = x

    def copy_rows(self, src: int, dst: int, length: int) -> None:
        """Positions ``0 .. length - 1`` of row ``src`` into row ``dst``'s pages (every layer, the verifier's and the
        stash; whole pages: positions past ``length`` of the last one are rewritten before they are read)."""
        n = pages_for(length, self.page_size)
        if n == 0:
            return
        s = torch.tensor(self.pages.tables[src][:n], dtype=torch.long, device=self.table.device)
        d = torch.tensor(self.pages.tables[dst][:n], dtype=torch.long, device=self.table.device)
        for k, v in self.layers + (self.verify_layers or []):
            k[d] = k[s]
            v[d] = v[s]
        if self.stash is not None:
            self.stash[d] = self.stash[s]

    @property
    def nbytes(self) -> int:
        bufs = [t for kv in self.layers + (self.verify_layers or []) for t in kv] + [self.tail_enc, self.table]
        if self.stash is not None:
            bufs.append(self.stash)
        return sum(t.numel() * t.element_size() for t in bufs)


def gather_pages(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, read_len: int) -> torch.Tensor:
    """``cache`` [pages, nkv, P, hd] read through ``table`` [rows, pages] → ``[len(rows), nkv, read_len, hd]``."""
    P = cache.shape[2]
    n = -(-read_len // P)
    pages = cache[table[rows, :n]]  # [B, n, nkv, P, hd]
    B, _, nkv, _, hd = pages.shape
    return pages.transpose(1, 2).reshape(B, nkv, n * P, hd)[:, :, :read_len]
