"""How prompts are prefilled: positions below ``ROW_PREFILL_END`` as rows of one ``dmtd::rows_layers`` call per
layer group, several prompts together, later ones in chunks through SDPA at boundaries fixed from position 0. A
part of :class:`dmtd.engine.runner.ModelRunner`, kept apart so the runner reads as its pass kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmtd.engine.model import StepContext, Transformer, route_decoding_input
from dmtd.engine.sequence import Sequence

if TYPE_CHECKING:
    from dmtd.engine.config import DMTDConfig, EngineConfig
    from dmtd.engine.kv_cache import KVCache
    from dmtd.engine.model import LayerWeights
    from dmtd.engine.verifier import Verifier

# prompt positions below this run as rows of one dmtd::rows_layers call per step, several prompts together (each
# row alone: the bits of a position do not depend on the rows beside it); later ones in chunks through SDPA, whose
# matrix products read long contexts faster than one row's attention at a time
ROW_PREFILL_END = 256


class Prefill:
    """Prompt prefill (mixed into the runner, whose model, caches and contexts it uses)."""

    model: Transformer
    dmtd: DMTDConfig
    cfg: EngineConfig
    device: torch.device
    act_dtype: torch.dtype
    weights: list[LayerWeights]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    cache: KVCache
    verifier: Verifier
    verify_weights: list[LayerWeights]
    verify_kv: list[tuple[torch.Tensor, torch.Tensor]] | None

    if TYPE_CHECKING:  # the runner's own
        def logits(self, h: torch.Tensor) -> torch.Tensor: ...
        def enable_exact(self) -> None: ...
        def _context(self, kv_rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None) -> StepContext: ...

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prompt positions ``num_prefilled .. prefill_end`` of each sequence through every layer, in chunks whose
        boundaries sit at multiples of ``prefill_chunk`` from position 0; logits of the last prompt position of
        each sequence whose prompt this completes [n, V].

        One chunk of one prompt at a time: a batch pads its prompts to the longest and masks attention, and the
        padded length changes the order in which a position's attention is summed. A chunk's rows, attention
        reads and arithmetic depend on its tokens and those before it alone, so a prompt's KV and logits have
        the same bits whatever arrived with it, however its prefill was split over steps, and whether its first
        chunks were computed or taken from the prefix cache (the exact profile compares them with the base
        model's own).
        """
        C = self.cfg.prefill_chunk
        last: dict[int, torch.Tensor] = {}  # sequence index → its last prompt position's output [1, H]
        rows = self._row_chunks(seqs)
        if rows:
            last.update(self._prefill_rows(seqs, rows))
        for i, s in enumerate(seqs):
            start = max(s.num_prefilled, rows.get(i, (0, s.num_prefilled))[1])
            stop = min(s.prefill_end, s.prompt_len)
            while start < stop:
                end = min((start // C + 1) * C, stop)
                last[i] = self._prefill_chunk(s, start, end)[:, -1]
                start = end
            if start < s.prefill_end:
                self._prefill_generated(s, start, s.prefill_end)
        done = [self.logits(last[i]) for i, s in enumerate(seqs) if s.prefill_end == s.num_tokens]
        if not done:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return torch.cat(done)

    def _prefill_generated(self, s: Sequence, start: int, end: int) -> None:
        """Positions ``start .. end - 1`` of a preempted sequence's own tokens, each computed as the decode step that
        first fed it computed it: as rows where the rows op runs (a row's bits do not depend on the pass), else one
        position a pass; tails routed as tails (:attr:`Sequence.tail_positions`)."""
        if self._rows_ok([s]):
            self._prefill_rows([s], {0: (start, end)})
            return
        for p in range(start, end):
            self._prefill_chunk(s, p, p + 1)

    def _heads(self, s: Sequence, pos: torch.Tensor) -> torch.Tensor:
        """Which of ``s``'s positions ``pos`` route the deep state into the decoding group: prompt positions by the
        phase convention, its own tokens' positions (a resume after a preemption) as they were fed."""
        head = pos % s.tau == 0 if self.dmtd.phase_anchor == "absolute" else torch.ones_like(pos, dtype=torch.bool)
        if s.tail_positions and int(pos.max()) >= s.prompt_len:
            tails = torch.tensor(sorted(s.tail_positions), device=pos.device)
            gen = pos >= s.prompt_len
            head = torch.where(gen, ~torch.isin(pos, tails), head)
        return head

    def _row_chunks(self, seqs: list[Sequence]) -> dict[int, tuple[int, int]]:
        """Each sequence's positions this step that run as rows of one ``dmtd::rows_layers`` call with the others'
        (index → start, end): those below ``ROW_PREFILL_END`` where layer groups run in one call (packed weights,
        the kernels built). Which positions do is a function of the positions alone, never of what shares the
        step: a row is computed alone, so a prompt's bits do not depend on the prompts batched with it."""
        if not self._rows_ok(seqs):
            return {}
        out = {}
        for i, s in enumerate(seqs):
            end = min(s.prefill_end, ROW_PREFILL_END)
            if s.num_prefilled < end:
                out[i] = (s.num_prefilled, end)
        return out

    def _rows_ok(self, seqs: list[Sequence]) -> bool:
        """Whether these sequences' positions can run as rows of ``dmtd::rows_layers`` (packed weights, the kernels
        built, float32 KV)."""
        if not self.model.fused_layers:
            return False
        if any(s.params.exact for s in seqs):
            self.enable_exact()
        return self._rows_prefill_ok()

    def _rows_prefill_ok(self) -> bool:
        m, d = self.model, self.dmtd
        groups = [(0, d.thinking_start), (d.thinking_start, d.decoding_start), (d.decoding_start, d.num_layers)]
        if any(a < b and m.rows_args(self.weights, self.kv, a, b) is None for a, b in groups):
            return False
        if self.verify_kv is None:
            return True
        return m.rows_args(self.verify_weights, self.verify_kv, d.decoding_start, d.num_layers) is not None

    def _prefill_rows(self, seqs: list[Sequence], rows: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """The prompt positions ``rows`` of several sequences as the rows of one pass per layer group; the output
        [1, H] of each sequence's last row."""
        m, d, dev = self.model, self.dmtd, self.device
        self.cache.sync()
        order = sorted(rows)
        ids = [t for i in order for t in seqs[i].token_ids[rows[i][0]: rows[i][1]]]
        pos = torch.tensor([p for i in order for p in range(*rows[i])], device=dev)
        kv_rows = torch.tensor([seqs[i].kv_row for i in order for _ in range(*rows[i])], device=dev)
        owner = torch.tensor([k for k, i in enumerate(order) for _ in range(*rows[i])], device=dev)
        none = torch.empty(0, device=dev)
        ctx = StepContext(none, none, None, int(pos.max()) + 1, kv_rows[:0], self.cache.table, kv_rows, pos,
                          None)  # rows_layers reads only the rows' cache rows and positions
        x = m.embed_tokens(torch.tensor([ids], device=dev)).to(self.act_dtype)
        h_enc = m.run_rows(x, 0, d.thinking_start, self.kv, ctx, self.weights)
        h_think = m.run_rows(h_enc, d.thinking_start, d.decoding_start, self.kv, ctx, self.weights)
        head = torch.cat([self._heads(seqs[i], torch.arange(*rows[i], device=dev)) for i in order])[None]
        h = m.run_rows(route_decoding_input(h_enc, h_think, head, d.head_input), d.decoding_start, d.num_layers,
                       self.kv, ctx, self.weights)
        exact = [k for k, i in enumerate(order) if seqs[i].params.exact]
        if exact:  # the verifying path over the exact sequences' rows: its outputs are theirs
            assert self.verify_kv is not None
            keep = torch.isin(owner, torch.tensor(exact, device=dev))
            vctx = StepContext(ctx.cos, ctx.sin, None, ctx.read_len, kv_rows[:0], ctx.table, kv_rows[keep], pos[keep],
                               None)
            xv = route_decoding_input(h_enc[:, keep], h_think[:, keep], torch.ones_like(head[:, keep]),
                                      self.verifier.head_input)
            h = h.clone()
            h[:, keep] = m.run_rows(xv, d.decoding_start, d.num_layers, self.verify_kv, vctx, self.verify_weights)
        ends = torch.cumsum(torch.tensor([rows[i][1] - rows[i][0] for i in order]), 0) - 1
        return {i: h[:, int(ends[k])] for k, i in enumerate(order)}

    def _prefill_chunk(self, s: Sequence, start: int, end: int) -> torch.Tensor:
        """Positions ``start .. end - 1`` of one prompt through every layer (and the verifying path's decoding
        group, for an exact request); the last layer's output [1, end - start, H]."""
        m, d = self.model, self.dmtd
        ids = torch.tensor([s.token_ids[start:end]], device=self.device)
        pos = torch.arange(start, end, device=self.device)[None]
        ctx = self._context([s.kv_row], pos, None)
        h_enc = m.run_layers(m.embed_tokens(ids).to(self.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             self.kv, ctx, self.weights)
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, self.kv, ctx,
                               self.weights)
        head = self._heads(s, pos[0])[None]
        x = route_decoding_input(h_enc, h_think, head, d.head_input)
        # The decoding group must still write KV for every prompt position; logits only for the last.
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx, self.weights)
        if s.params.exact:  # verified cycles: the prompt through the verifying path too; its logits are the output
            self.enable_exact()
            xv = route_decoding_input(h_enc, h_think, torch.ones_like(head), self.verifier.head_input)
            h = m.run_layers(xv, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.verify_kv, ctx,
                             self.verify_weights)
        return h
