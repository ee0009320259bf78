"""The passes of verified cycles: the tails' draft steps and the heads' checks, with the prompt rows that may ride on
a check. A part of :class:`dmtd.engine.runner.ModelRunner`, kept apart so the runner reads as its pass kinds."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dmtd.engine import lowbit
from dmtd.engine.draft_policy import DENSE_DRAFT_ROWS
from dmtd.engine.model import StepContext, project, route_decoding_input
from dmtd.engine.ops import kernel_path
from dmtd.engine.runner_part import RunnerPart
from dmtd.engine.sequence import Sequence

if TYPE_CHECKING:
    from dmtd.engine.model import LayerWeights
    from dmtd.engine.prefill import RidingRows

MAX_CONTEXT_IDS = 1024  # context ids a draft pass adds to the draft vocabulary at most


class VerifiedPasses(RunnerPart):
    """Draft and check passes (mixed into the runner, whose model, caches and contexts they use)."""

    draft_weights: list[LayerWeights]
    draft_ids: torch.Tensor | None
    pass_draft_ids: torch.Tensor | None
    prompt_logits: torch.Tensor
    _draft_id_set: set[int] | None
    _context_head: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None
    _fused: dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]] | None

    if TYPE_CHECKING:  # the runner's own, and the prefill part's
        def draft_head(self) -> torch.Tensor | lowbit.PackedWeight: ...
        def tail_head(self) -> torch.Tensor | lowbit.PackedWeight: ...
        def _heads(self, s: Sequence, pos: torch.Tensor) -> torch.Tensor: ...
        def _rows_context(self, kv_rows: torch.Tensor, pos: torch.Tensor, prompt: torch.Tensor) -> StepContext: ...
        def _riding_rows(self, prompts: list[Sequence]) -> RidingRows: ...
        def _riders_logits(self, h: torch.Tensor, start: int, prompts: list[Sequence],
                           spans: list[tuple[int, int]]) -> torch.Tensor: ...
        def _tail_rows(self, x: torch.Tensor, late: torch.Tensor, seqs: list[Sequence], exact_now: bool,
                       ctx_of: Callable[[torch.Tensor | slice], StepContext]) -> torch.Tensor: ...
        def _right_aligned(self, last: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence]) -> torch.Tensor:
        """Tail steps of verified cycles: the draft head's logits at each row's draft position [n, N].

        A row's tail path first catches up on positions checked since its last draft (the head-routed
        decoding input stashed by :meth:`verify`), in the same causal pass as the new tail position.
        """
        m, d, dev = self.model, self.dmtd, self.device
        assert self.cache.stash is not None
        kv_rows = [s.kv_row for s in seqs]
        last = [s.draft_position for s in seqs]
        counts = [q - s.num_tail_cached + 1 for s, q in zip(seqs, last)]
        ids = torch.tensor([[s.draft.tokens[-1] if s.draft.tokens else s.token_ids[-1]] for s in seqs], device=dev)
        if self._fused is not None and len(seqs) == 1:  # one sequence: its layers in one call each group
            s, q = seqs[0], last[0]
            x = self._draft_stack(m.embed_tokens(ids[0]).to(self.act_dtype), 0, d.thinking_start, s.kv_row, q)
            if counts[0] > 1:
                x = torch.cat((self.cache.stash_read(s.kv_row, s.num_tail_cached, q), x))
            h = self._draft_stack(x, d.decoding_start, d.num_layers, s.kv_row, q)
            return self._draft_logits(m.norm.forward(h[-1:]), seqs)
        # many rows: the engine's own weights where its kernel is the faster one (draft_policy.DENSE_DRAFT_ROWS)
        dense = self.draft_weights is not self.weights and len(seqs) >= DENSE_DRAFT_ROWS.get(kernel_path(), 1 << 30)
        weights = self.weights if dense else self.draft_weights
        ctx = self._context(kv_rows, torch.tensor([[q] for q in last], device=dev), None)
        x = m.run_layers(m.embed_tokens(ids).to(self.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin, self.kv, ctx,
                         weights)
        if max(counts) > 1:
            pos, valid = self._right_aligned(last, counts)
            R = pos.shape[1]
            tail = x
            x = torch.zeros(len(seqs), R, tail.shape[-1], dtype=self.act_dtype, device=dev)
            x[:, -1] = tail[:, 0]
            for i, s in enumerate(seqs):
                if counts[i] > 1:
                    x[i, R - counts[i]: R - 1] = self.cache.stash_read(s.kv_row, s.num_tail_cached, last[i])
            ctx = self._context(kv_rows, pos, valid)
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.kv, ctx, weights)
        return self._draft_logits(m.norm.forward(h[:, -1]), seqs, dense)

    def _draft_logits(self, h: torch.Tensor, seqs: list[Sequence], dense: bool = False) -> torch.Tensor:
        """The draft head's logits [n, N + E] over the draft vocabulary and then, for greedy rows, the E ids of the
        rows' contexts outside it (``pass_draft_ids`` maps columns to token ids). A restricted vocabulary chosen
        from a corpus misses the words of a prompt's own topic ('refrigerator', 'gears', 'keeper' on the demo's chat
        prompts), each a draft that could only be rejected, and those are the words an answer repeats; their head
        rows cost a few hundred multiply-adds each."""
        logits = project(h, self.tail_head() if dense else self.draft_head())
        self.pass_draft_ids = self.draft_ids
        if self._draft_id_set is None or not self.cfg.context_vocab or not all(s.params.greedy for s in seqs):
            return logits
        extra: set[int] = set()
        for s in seqs:
            st = s.draft
            st.context_vocab.update(t for t in s.token_ids[st.context_vocab_seen:] if t not in self._draft_id_set)
            st.context_vocab_seen = len(s.token_ids)
            extra |= st.context_vocab
        if not extra:
            return logits
        key = tuple(sorted(extra)[:MAX_CONTEXT_IDS])
        if self._context_head is None or self._context_head[0] != key:
            ids = torch.tensor(key, device=self.device)
            m = self.model
            # float32 columns: a bfloat16 product of one row with a few hundred columns takes torch's slow path on
            # CPUs without bfloat16 arithmetic
            cols = (m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight.t())[ids].t().float().contiguous()
            self._context_head = (key, torch.cat((self.draft_ids, ids)), cols)  # type: ignore[arg-type]
        _, self.pass_draft_ids, cols = self._context_head
        return torch.cat((logits.float(), h.float() @ cols), dim=-1)

    def _draft_stack(self, h: torch.Tensor, start: int, end: int, kv_row: int, last: int) -> torch.Tensor:
        """Layers ``start..end`` of the draft path over rows ``h`` [R, H]: one sequence's positions
        ``last - R + 1 .. last`` (``dmtd::draft_layers``, the packed draft weights)."""
        if start == end:
            return h
        assert self._fused is not None
        self.cache.sync()
        cfg, R = self.model.config, h.shape[0]
        pos = torch.arange(last - R + 1, last + 1, device=self.device)
        mode, cols = self._fused[(start, end)]
        cos, sin = self.model.rope_cos, self.model.rope_sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        return torch.ops.dmtd.draft_layers(
            h, *cols, self.cache.table, cos[pos], sin[pos], kv_row, last + 1, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, mode)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], prompts: list[Sequence] | None = None) -> torch.Tensor:
        """Heads of verified cycles: the verifier's logits over each row's last token and its drafts.

        Returns [n, R, V], right-aligned: row i's ``len(drafts) + 1`` predictions are its last columns.
        Every layer group writes KV at those positions (thinking and encoding shared, decoding into the
        verifier's own), and the tail path's head-routed input is stashed for the next draft step.

        ``prompts``: sequences whose positions ``num_prefilled .. prefill_end`` ride along as rows of the same
        calls (prompts run as rows here: :meth:`rows_prefill`), so a prompt's prefill shares the check's weight
        reads instead of taking a step of its own; what :meth:`prefill` would return for them is left in
        ``prompt_logits``. Every row is computed alone: each has the bits it has in a pass of its own.
        """
        if prompts:  # (the engine passes only prompts with positions to compute)
            return self._verify_with_prompts(seqs, prompts)
        m, d, dev = self.model, self.dmtd, self.device
        assert self.verify_kv is not None and self.cache.stash is not None
        counts = [len(s.draft.tokens) + 1 for s in seqs]
        pos, valid = self._right_aligned([s.draft_position for s in seqs], counts)
        R = pos.shape[1]
        ids = torch.zeros(len(seqs), R, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, R - counts[i]:] = torch.tensor([s.token_ids[-1], *s.draft.tokens])
        ctx = self._context([s.kv_row for s in seqs], pos, valid)
        h_enc = m.run_layers(m.embed_tokens(ids.to(dev)).to(self.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             self.kv, ctx, self.weights)
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, self.kv, ctx,
                               self.weights)
        heads = torch.ones(pos.shape, dtype=torch.bool, device=dev)
        xv = route_decoding_input(h_enc, h_think, heads, self.verifier.head_input)
        h = m.run_layers(xv, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, self.verify_kv, ctx,
                         self.verify_weights)
        xt = route_decoding_input(h_enc, h_think, heads, d.head_input).reshape(-1, h_enc.shape[-1])
        self.cache.stash_write(ctx.write_kv_rows, ctx.write_pos, xt if ctx.write_rows is None else xt[ctx.write_rows])
        if valid is None:
            return self.logits(h)
        # the lm_head over the real rows only: one row's drafts widened the whole batch's head to R rows a sequence
        flat = self.logits(h[valid])
        logits = flat.new_empty(*pos.shape, flat.shape[-1])  # padding entries: nothing reads them
        logits[valid] = flat
        return logits

    def _verify_with_prompts(self, seqs: list[Sequence], prompts: list[Sequence]) -> torch.Tensor:
        """:meth:`verify` with prompt rows in the same ``dmtd::rows_layers`` calls: the checks' rows first, then each
        prompt's positions; the verifying path over the checks' rows and the exact prompts', the variant's decoding
        group over the prompts' (as :meth:`_prefill_rows` runs them)."""
        m, d, dev = self.model, self.dmtd, self.device
        assert self.verify_kv is not None and self.cache.stash is not None
        self.cache.sync()
        counts = [len(s.draft.tokens) + 1 for s in seqs]
        ids = [t for s in seqs for t in (s.token_ids[-1], *s.draft.tokens)]
        pos_l = [p for s, c in zip(seqs, counts) for p in range(s.draft_position - c + 1, s.draft_position + 1)]
        kv_l = [s.kv_row for s, c in zip(seqs, counts) for _ in range(c)]
        nc = len(ids)
        riding = self._riding_rows(prompts)
        spans = riding.spans
        ids += riding.ids
        pos = torch.tensor(pos_l + riding.pos, device=dev)
        kv_rows = torch.tensor(kv_l + riding.kv_rows, device=dev)
        is_prompt = torch.tensor([False] * nc + riding.prompt, device=dev)  # the checks' rows are decode rows

        def rows_ctx(keep: torch.Tensor | slice) -> StepContext:
            return self._rows_context(kv_rows[keep], pos[keep], is_prompt[keep])

        ctx = rows_ctx(slice(None))
        x = m.embed_tokens(torch.tensor([ids], device=dev)).to(self.act_dtype)
        h_enc = m.run_rows(x, 0, d.thinking_start, self.kv, ctx, self.weights)
        h_think = m.run_rows(h_enc, d.thinking_start, d.decoding_start, self.kv, ctx, self.weights)
        # the verifying path: the checks' rows and the exact prompts' (their outputs are the prompts' own)
        exact = torch.tensor([True] * nc + [s.params.exact for s, (a, b) in zip(prompts, spans) for _ in range(a, b)],
                             device=dev)
        ones = torch.ones((1, len(ids)), dtype=torch.bool, device=dev)
        xv = route_decoding_input(h_enc[:, exact], h_think[:, exact], ones[:, exact], self.verifier.head_input)
        hv = m.run_rows(xv, d.decoding_start, d.num_layers, self.verify_kv, rows_ctx(exact), self.verify_weights)
        # the variant's decoding group over the prompts' rows (the tails read their KV), heads by the phase rules;
        # an exact prompt's at the next step's start (Prefill.catch_up)
        prompt = slice(nc, None)
        head = torch.cat([self._heads(s, torch.arange(a, b, device=dev)) for s, (a, b) in zip(prompts, spans)])[None]
        due = [s.params.exact and b == s.num_tokens for s, (a, b) in zip(prompts, spans)]  # first token due
        hp = self._tail_rows(route_decoding_input(h_enc[:, prompt], h_think[:, prompt], head, d.head_input),
                             torch.tensor([f for f, (a, b) in zip(due, spans) for _ in range(a, b)], dtype=torch.bool,
                                          device=dev), [s for s, f in zip(prompts, due) if f],
                             any(s.params.exact and b < s.num_tokens for s, (a, b) in zip(prompts, spans)),
                             lambda keep: rows_ctx(torch.arange(nc, len(ids), device=dev)[keep]))
        out = h_enc.new_empty(h_enc.shape)
        out[:, prompt] = hp
        out[:, exact] = hv
        # the checks: the tail path's head-routed input stashed, logits right-aligned [n, R, V]
        xt = route_decoding_input(h_enc[0, :nc], h_think[0, :nc], ones[0, :nc], d.head_input)
        self.cache.stash_write(kv_rows[:nc], pos[:nc], xt)
        flat = self.logits(out[0, :nc])
        R = max(counts)
        logits = flat.new_zeros(len(seqs), R, flat.shape[-1])
        ends = torch.cumsum(torch.tensor(counts), 0).tolist()
        for i, (c, e) in enumerate(zip(counts, ends)):
            logits[i, R - c:] = flat[e - c: e]
        self.prompt_logits = self._riders_logits(out[0], nc, prompts, spans)
        return logits
