"""The passes of verified cycles: the tails' draft steps and the heads' checks, with the prompt rows that may ride on
a check. The runner's verified-pass runner (:class:`VerifiedPassRunner`), given the model state, the drafts' weights and
the prefill runner (whose riding rows a check carries)."""

from __future__ import annotations

import torch

from dmtd.engine.draft_policy import DENSE_DRAFT_ROWS
from dmtd.engine.draft_weights import DraftWeights
from dmtd.engine.model import StepContext, project, route_decoding_input
from dmtd.engine.model_state import ModelState
from dmtd.engine.ops import kernel_path
from dmtd.engine.prefill import PrefillRunner
from dmtd.engine.sequence import Sequence

MAX_CONTEXT_IDS = 1024  # context ids a draft pass adds to the draft vocabulary at most


class VerifiedPassRunner:
    """Draft and check passes over the model ``state``: drafts on ``drafts``' weights, checks on the verifying
    path's, riding prompts' product rows through ``prefill``."""

    def __init__(self, state: ModelState, drafts: DraftWeights, prefill: PrefillRunner) -> None:
        self.state = state
        self.drafts = drafts
        self.prefill_runner = prefill

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence]) -> torch.Tensor:
        """Tail steps of verified cycles: the draft head's logits at each sequence's draft position [n, N].

        A sequence's tail path first catches up on positions checked since its last draft (the head-routed
        decoding input stashed by :meth:`verify`), in the same causal pass as the new tail position.
        """
        st = self.state
        m, d, dev = st.model, st.dmtd, st.device
        assert st.cache.stash is not None
        kv_rows = [s.kv_row for s in seqs]
        last = [s.draft_position for s in seqs]
        counts = [q - s.num_tail_cached + 1 for s, q in zip(seqs, last)]
        ids = torch.tensor([[s.draft.tokens[-1] if s.draft.tokens else s.token_ids[-1]] for s in seqs], device=dev)
        fused = self.drafts.fused_for(seqs[0].variant) if len(seqs) == 1 else None
        if fused is not None:  # one sequence: its layers in one call each group
            s, q = seqs[0], last[0]
            x = self._draft_stack(m.embed_tokens(ids[0]).to(st.act_dtype), 0, d.thinking_start, s.kv_row, q, fused)
            if counts[0] > 1:
                x = torch.cat((st.cache.stash_read(s.kv_row, s.num_tail_cached, q), x))
            h = self._draft_stack(x, d.decoding_start, d.num_layers, s.kv_row, q, fused)
            return self._draft_logits(m.norm.forward(h[-1:]), seqs)
        # many rows: the engine's own weights where its kernel is the faster one (draft_policy.DENSE_DRAFT_ROWS)
        dense = (self.drafts.layers is not st.weights
                 and len(seqs) >= DENSE_DRAFT_ROWS.get(kernel_path(), 1 << 30))
        pos, valid = torch.tensor([[q] for q in last], device=dev), None
        ctx = st.context(kv_rows, pos, valid)
        x = m.run_layers(m.embed_tokens(ids).to(st.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin, st.kv, ctx,
                         st.weights if dense else self.drafts.layers)
        if max(counts) > 1:
            pos, valid = st.right_aligned(last, counts)
            R = pos.shape[1]
            tail = x
            x = torch.zeros(len(seqs), R, tail.shape[-1], dtype=st.act_dtype, device=dev)
            x[:, -1] = tail[:, 0]
            for i, s in enumerate(seqs):
                if counts[i] > 1:
                    x[i, R - counts[i]: R - 1] = st.cache.stash_read(s.kv_row, s.num_tail_cached, last[i])
            ctx = st.context(kv_rows, pos, valid)
        h = st.decoding_batch(x, [s.variant for s in seqs], kv_rows, pos, valid, ctx,
                              st.weights_of if dense else self.drafts.layers_for)
        return self._draft_logits(m.norm.forward(h[:, -1]), seqs, dense)

    def _draft_logits(self, h: torch.Tensor, seqs: list[Sequence], dense: bool = False) -> torch.Tensor:
        """The draft head's logits [n, N + E] over the draft vocabulary and then, for greedy sequences, the E ids of
        their contexts outside it (``pass_draft_ids`` maps columns to token ids). A restricted vocabulary chosen
        from a corpus misses the words of a prompt's own topic ('refrigerator', 'gears', 'keeper' on the demo's chat
        prompts), each a draft that could only be rejected, and those are the words an answer repeats; their head
        rows cost a few hundred multiply-adds each."""
        dw = self.drafts
        logits = project(h, dw.tail_head() if dense else dw.draft_head())
        dw.pass_ids = dw.ids
        if dw.id_set is None or not self.state.cfg.context_vocab or not all(s.params.greedy for s in seqs):
            return logits
        extra: set[int] = set()
        for s in seqs:
            ds = s.draft
            ds.context_vocab.update(t for t in s.token_ids[ds.context_vocab_seen:] if t not in dw.id_set)
            ds.context_vocab_seen = len(s.token_ids)
            extra |= ds.context_vocab
        if not extra:
            return logits
        key = tuple(sorted(extra)[:MAX_CONTEXT_IDS])
        if dw.context_head is None or dw.context_head[0] != key:
            ids = torch.tensor(key, device=self.state.device)
            m = self.state.model
            # float32 columns: a bfloat16 product of one row with a few hundred columns takes torch's slow path on
            # CPUs without bfloat16 arithmetic
            cols = (m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight.t())[ids].t().float().contiguous()
            dw.context_head = (key, torch.cat((dw.ids, ids)), cols)  # type: ignore[arg-type]
        _, dw.pass_ids, cols = dw.context_head
        return torch.cat((logits.float(), h.float() @ cols), dim=-1)

    def _draft_stack(self, h: torch.Tensor, start: int, end: int, kv_row: int, last: int,
                     fused: dict[tuple[int, int], tuple[int, list[list[torch.Tensor]]]]) -> torch.Tensor:
        """Layers ``start..end`` of the draft path over rows ``h`` [R, H]: one sequence's positions
        ``last - R + 1 .. last`` (``dmtd::draft_layers``, the packed draft weights' arguments ``fused``)."""
        st = self.state
        if start == end:
            return h
        st.cache.sync()
        cfg, R = st.model.config, h.shape[0]
        pos = torch.arange(last - R + 1, last + 1, device=st.device)
        mode, cols = fused[(start, end)]
        cos, sin = st.model.rope_cos, st.model.rope_sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        return torch.ops.dmtd.draft_layers(
            h, *cols, st.cache.table, cos[pos], sin[pos], kv_row, last + 1, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, mode)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], prompts: list[Sequence] | None = None) -> torch.Tensor:
        """Heads of verified cycles: the verifier's logits over each sequence's last token and its drafts.

        Returns [n, R, V], right-aligned: sequence i's ``len(drafts) + 1`` predictions are its last columns.
        Every layer group writes KV at those positions (thinking and encoding shared, decoding into the
        verifier's own), and the tail path's head-routed input is stashed for the next draft step.

        ``prompts``: sequences whose positions ``num_prefilled .. prefill_end`` ride along as rows of the same
        calls (prompts run as rows here: :meth:`rows_prefill`), so a prompt's prefill shares the check's weight
        reads instead of taking a step of its own; what :meth:`prefill` would return for them is left in
        ``prompt_logits``. Every row is computed alone: each has the bits it has in a pass of its own.
        """
        st = self.state
        if prompts:  # (the engine passes only prompts with positions to compute)
            return self._verify_with_prompts(seqs, prompts)
        m, d, dev = st.model, st.dmtd, st.device
        assert st.verify_kv is not None and st.cache.stash is not None
        counts = [len(s.draft.tokens) + 1 for s in seqs]
        pos, valid = st.right_aligned([s.draft_position for s in seqs], counts)
        R = pos.shape[1]
        ids = torch.zeros(len(seqs), R, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, R - counts[i]:] = torch.tensor([s.token_ids[-1], *s.draft.tokens])
        ctx = st.context([s.kv_row for s in seqs], pos, valid)
        h_enc = m.run_layers(m.embed_tokens(ids.to(dev)).to(st.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             st.kv, ctx, st.weights)
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, st.kv, ctx,
                               st.weights)
        heads = torch.ones(pos.shape, dtype=torch.bool, device=dev)
        xv = route_decoding_input(h_enc, h_think, heads, st.verifier.head_input)
        h = m.run_layers(xv, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, st.verify_kv, ctx,
                         st.verify_weights)
        xt = route_decoding_input(h_enc, h_think, heads, d.head_input).reshape(-1, h_enc.shape[-1])
        st.cache.stash_write(ctx.write_kv_rows, ctx.write_pos, xt if ctx.write_rows is None else xt[ctx.write_rows])
        if valid is None:
            return st.logits(h)
        # the lm_head over the real rows only: one sequence's drafts widened the whole batch's head to R rows each
        flat = st.logits(h[valid])
        logits = flat.new_empty(*pos.shape, flat.shape[-1])  # padding entries: nothing reads them
        logits[valid] = flat
        return logits

    def _verify_with_prompts(self, seqs: list[Sequence], prompts: list[Sequence]) -> torch.Tensor:
        """:meth:`verify` with prompt rows in the same ``dmtd::rows_layers`` calls: the checks' rows first, then each
        prompt's positions; the verifying path over the checks' rows and the exact prompts', the variant's decoding
        group over the prompts' (as :meth:`_prefill_rows` runs them)."""
        st = self.state
        m, d, dev = st.model, st.dmtd, st.device
        assert st.verify_kv is not None and st.cache.stash is not None
        st.cache.sync()
        counts = [len(s.draft.tokens) + 1 for s in seqs]
        ids = [t for s in seqs for t in (s.token_ids[-1], *s.draft.tokens)]
        pos_l = [p for s, c in zip(seqs, counts) for p in range(s.draft_position - c + 1, s.draft_position + 1)]
        kv_l = [s.kv_row for s, c in zip(seqs, counts) for _ in range(c)]
        nc = len(ids)
        riding = PrefillRunner.riding_rows(prompts)
        spans = riding.spans
        ids += riding.ids
        pos = torch.tensor(pos_l + riding.pos, device=dev)
        kv_rows = torch.tensor(kv_l + riding.kv_rows, device=dev)
        is_prompt = torch.tensor([False] * nc + riding.prompt, device=dev)  # the checks' rows are decode rows

        def rows_ctx(keep: torch.Tensor | slice) -> StepContext:
            return st.rows_context(kv_rows[keep], pos[keep], is_prompt[keep])

        ctx = rows_ctx(slice(None))
        x = m.embed_tokens(torch.tensor([ids], device=dev)).to(st.act_dtype)
        h_enc = m.run_rows(x, 0, d.thinking_start, st.kv, ctx, st.weights)
        h_think = m.run_rows(h_enc, d.thinking_start, d.decoding_start, st.kv, ctx, st.weights)
        # the verifying path: the checks' rows and the exact prompts' (their outputs are the prompts' own)
        exact = torch.tensor([True] * nc + [s.params.exact for s, (a, b) in zip(prompts, spans) for _ in range(a, b)],
                             device=dev)
        ones = torch.ones((1, len(ids)), dtype=torch.bool, device=dev)
        xv = route_decoding_input(h_enc[:, exact], h_think[:, exact], ones[:, exact], st.verifier.head_input)
        hv = m.run_rows(xv, d.decoding_start, d.num_layers, st.verify_kv, rows_ctx(exact), st.verify_weights)
        # the variant's decoding group over the prompts' rows (the tails read their KV), heads by the phase rules;
        # an exact prompt's at the next step's start (PrefillRunner.catch_up)
        pr = self.prefill_runner
        prompt = slice(nc, None)
        head = torch.cat([pr.head_mask(s, torch.arange(a, b, device=dev)) for s, (a, b) in zip(prompts, spans)])[None]
        due = [s.params.exact and b == s.num_tokens for s, (a, b) in zip(prompts, spans)]  # first token due
        late = torch.tensor([f for f, (a, b) in zip(due, spans) for _ in range(a, b)], dtype=torch.bool, device=dev)
        hp = pr.variant_decoding_rows(route_decoding_input(h_enc[:, prompt], h_think[:, prompt], head, d.head_input),
                                      late, [s for s, f in zip(prompts, due) if f],
                                      any(s.params.exact and b < s.num_tokens for s, (a, b) in zip(prompts, spans)),
                                      lambda keep: rows_ctx(torch.arange(nc, len(ids), device=dev)[keep]),
                                      [s.variant for s, (a, b) in zip(prompts, spans) for _ in range(a, b)])
        out = h_enc.new_empty(h_enc.shape)
        out[:, prompt] = hp
        out[:, exact] = hv
        # the checks: the tail path's head-routed input stashed, logits right-aligned [n, R, V]
        xt = route_decoding_input(h_enc[0, :nc], h_think[0, :nc], ones[0, :nc], d.head_input)
        st.cache.stash_write(kv_rows[:nc], pos[:nc], xt)
        flat = st.logits(out[0, :nc])
        R = max(counts)
        logits = flat.new_zeros(len(seqs), R, flat.shape[-1])
        ends = torch.cumsum(torch.tensor(counts), 0).tolist()
        for i, (c, e) in enumerate(zip(counts, ends)):
            logits[i, R - c:] = flat[e - c: e]
        pr.riders_logits(out[0], nc, prompts, spans)
        return logits
