"""How prompts are prefilled: as rows of one ``dmtd::rows_layers`` call per layer group, several prompts together, where
the rows op runs (packed weights, the kernels built, float32 KV: a CPU engine); elsewhere in chunks through SDPA at
boundaries fixed from position 0. The runner's prefill pass runner (:class:`PrefillRunner`), given the model state
it runs on; it also lends the passes that prompt rows ride on (a head step, a check) their riding rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from dmtd.engine.model import StepContext, route_decoding_input
from dmtd.engine.model_state import ModelState
from dmtd.engine.sequence import Sequence


class DeferredRows(NamedTuple):
    """Exact prompts' rows whose pass through the variant's decoding group waits for :meth:`PrefillRunner.catch_up`."""

    seqs: list[Sequence]  # whose rows they are
    x: torch.Tensor  # [n, H] the decoding group's input (head-routed by the phase rules)
    kv_rows: torch.Tensor  # [n] each row's cache row
    pos: torch.Tensor  # [n] its position
    prompt: torch.Tensor  # [n] whether it is a prompt's position (not a resumed sequence's own token)
    variants: list[str]  # [n] whose tails each row's sequence runs


class RidingRows(NamedTuple):
    """Prompts' positions ``num_prefilled .. prefill_end`` as flat rows of a pass they ride on."""

    spans: list[tuple[int, int]]  # each prompt's (num_prefilled, prefill_end)
    ids: list[int]  # each row's token
    pos: list[int]  # its position
    kv_rows: list[int]  # its cache row
    prompt: list[bool]  # a prompt's position (a resumed sequence's own tokens are decode rows)


class PrefillRunner:
    """Prompt prefill, on the runner's model ``state``; ``enable_exact`` switches the verifying path on (the runner's,
    which also builds the drafts' weights) when an exact prompt comes.

    An exact request's output comes from the verifier's decoding group; the variant's (the KV its drafts read) over
    its prompt waits, where ``draft_kv_after_first_token`` says so, until :meth:`catch_up` at the start of the next
    step: the first token goes out a fifth of the prefill's layers sooner. Nothing reads that KV before: the request
    drafts from its next step on, a prompt sharing its pages is an exact one (the prefix cache keys the profile)
    whose own deferred rows run after it in the same call, and the engine catches up before a row's pages are freed
    or copied (:meth:`owes_draft_kv`)."""

    def __init__(self, state: ModelState, enable_exact: Callable[[], None]) -> None:
        self.state = state
        self.enable_exact = enable_exact
        self.rows_promised = False  # rows_prefill() said yes: the engine relies on it
        self.deferred: list[DeferredRows] = []  # exact prompts' rows awaiting the variant's decoding group
        self.prompt_logits = torch.empty(0)  # the last pass's riding prompts' logits (riders_logits)

    def owes_draft_kv(self, seq: Sequence) -> bool:
        """Whether ``seq`` has rows waiting for :meth:`catch_up`."""
        return any(s is seq for d in self.deferred for s in d.seqs)

    @torch.inference_mode()
    def catch_up(self) -> torch.Tensor:
        """The deferred rows through the variant's decoding group, in one rows call (each row computed alone: the
        bits it would have had in the pass it was taken from); their outputs [1, n, H] (nobody reads them)."""
        st = self.state
        if not self.deferred:
            return torch.empty(1, 0, st.model.config.hidden_size, device=st.device)
        todo, self.deferred = self.deferred, []
        st.cache.sync()
        kv_rows, pos = torch.cat([t.kv_rows for t in todo]), torch.cat([t.pos for t in todo])
        prompt = torch.cat([t.prompt for t in todo])
        return st.decoding_rows(torch.cat([t.x for t in todo])[None], [v for t in todo for v in t.variants],
                                lambda keep: st.rows_context(kv_rows[keep], pos[keep], prompt[keep]))

    @staticmethod
    def riding_rows(prompts: list[Sequence]) -> RidingRows:
        """The positions to compute of prompts riding on a pass (a check, a head step), as its flat rows."""
        rows = RidingRows(spans=[(s.num_prefilled, s.prefill_end) for s in prompts], ids=[], pos=[], kv_rows=[],
                          prompt=[])
        for s, (a, b) in zip(prompts, rows.spans):
            rows.ids.extend(s.token_ids[a:b])
            rows.pos.extend(range(a, b))
            rows.kv_rows.extend([s.kv_row] * (b - a))
            rows.prompt.extend(p < s.prompt_len for p in range(a, b))
        return rows

    def riders_logits(self, h: torch.Tensor, start: int, prompts: list[Sequence],
                      spans: list[tuple[int, int]]) -> None:
        """``prompt_logits``: the logits [n, V] of the riding prompts this pass completes (what :meth:`prefill`
        returns for them), from the pass's last-layer rows ``h`` [R, H], the prompts' rows from ``start`` on."""
        st = self.state
        lasts, e = [], start
        for s, (a, b) in zip(prompts, spans):
            e += b - a
            if b == s.num_tokens:
                lasts.append(h[e - 1: e])
        self.prompt_logits = st.logits(torch.cat(lasts)) if lasts else h.new_empty(0, st.model.config.vocab_size)

    def variant_decoding_rows(self, x: torch.Tensor, late: torch.Tensor, seqs: list[Sequence], exact_now: bool,
                              ctx_of: Callable[[torch.Tensor | slice], StepContext],
                              variants: list[str]) -> torch.Tensor:
        """The variant's decoding group over rows ``x`` [1, n, H] (row r on ``variants[r]``'s layers, as
        :meth:`ModelState.decoding_rows`): now for every row, or, where
        ``draft_kv_after_first_token`` says so, now for the rows not in ``late`` [n] — the last rows of exact prompts
        whose first token this pass gives (of ``seqs``) — and at :meth:`catch_up` for those (their outputs here are
        left unset: the verifier's are theirs). A long prompt's earlier pieces keep theirs in their own pass: their
        cost is what the prefill pacer measured and budgeted. ``exact_now``: rows of exact prompts run now (they may
        read an earlier pass's deferred rows through shared pages: those are caught up first). ``ctx_of(keep)``: the
        rows' context."""
        st = self.state
        if exact_now:
            self.catch_up()
        if not (st.cfg.draft_kv_after_first_token and bool(late.any())):
            return st.decoding_rows(x, variants, ctx_of)
        full = ctx_of(slice(None))
        assert full.prompt_rows is not None
        flags = late.tolist()
        self.deferred.append(DeferredRows(seqs=seqs, x=x[0, late], kv_rows=full.write_kv_rows[late],
                                          pos=full.write_pos[late], prompt=full.prompt_rows[late],
                                          variants=[v for v, f in zip(variants, flags) if f]))
        h = x.new_empty(x.shape)
        rest = (~late).nonzero().squeeze(1)
        if len(rest):
            h[:, rest] = st.decoding_rows(x[:, rest], [variants[i] for i in rest.tolist()],
                                          lambda keep: ctx_of(rest[keep]))
        return h

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Positions ``num_prefilled .. prefill_end`` of each sequence through every layer; logits of the last prompt
        position of each sequence whose prompt this completes [n, V].

        As rows (:meth:`rows_prefill`): every position is computed alone — its arithmetic and the keys it reads
        depend on its tokens and those before it, never on the rows beside it — so a prompt's KV and logits have
        the same bits whatever arrived with it, wherever its prefill was split over steps (the scheduler splits
        it anywhere, :mod:`dmtd.engine.prefill_pacer`), and whether its first chunks were computed or taken from
        the prefix cache (the exact profile compares them with the base model's own). Otherwise one chunk of one
        prompt at a time, boundaries at multiples of ``prefill_chunk`` from position 0: a batch would pad its
        prompts to the longest and mask attention, and SDPA's sums over a chunk depend on the chunk's extent.
        """
        st = self.state
        last: dict[int, torch.Tensor] = {}  # sequence index → its last computed position's output [1, H]
        rows = self._rows_for(seqs)
        if not rows and self.rows_promised:  # the engine split prompts and shares pages on the rows' promise
            raise RuntimeError("prefill: the rows op no longer runs these layers (the verifier's weights?), and "
                               "SDPA chunks would give a prompt other bits than the prefix cache's pages")
        if rows:
            todo = {i: (s.num_prefilled, s.prefill_end) for i, s in enumerate(seqs) if s.num_prefilled < s.prefill_end}
            if todo:
                last = self._prefill_rows(seqs, todo)
        else:
            C = st.cfg.prefill_chunk
            for i, s in enumerate(seqs):
                start, stop = s.num_prefilled, min(s.prefill_end, s.prompt_len)
                while start < stop:
                    end = min((start // C + 1) * C, stop)
                    last[i] = self._prefill_chunk(s, start, end)[:, -1]
                    start = end
                for p in range(start, s.prefill_end):  # a preempted sequence's own tokens: one a pass, as decoded
                    self._prefill_chunk(s, p, p + 1)
        done = [st.logits(last[i]) for i, s in enumerate(seqs) if s.prefill_end == s.num_tokens]
        if not done:
            return torch.empty(0, st.model.config.vocab_size, device=st.device)
        return torch.cat(done)

    def rows_prefill(self) -> bool:
        """Whether prompts run as rows here (any split of a prompt over steps then gives the same bits); from the
        first answer on, prefill holds to it."""
        st = self.state
        self.rows_promised = bool(st.model.fused_layers) and self.rows_ok()
        return self.rows_promised

    def head_mask(self, s: Sequence, pos: torch.Tensor) -> torch.Tensor:
        """Which of ``s``'s positions ``pos`` route the deep state into the decoding group: prompt positions by the
        phase convention, its own tokens' positions (a resume after a preemption) as they were fed."""
        st = self.state
        head = pos % s.tau == 0 if st.dmtd.phase_anchor == "absolute" else torch.ones_like(pos, dtype=torch.bool)
        if s.tail_positions and int(pos.max()) >= s.prompt_len:
            tails = torch.tensor(sorted(s.tail_positions), device=pos.device)
            gen = pos >= s.prompt_len
            head = torch.where(gen, ~torch.isin(pos, tails), head)
        return head

    def _rows_for(self, seqs: list[Sequence]) -> bool:
        """Whether these sequences' positions can run as rows of ``dmtd::rows_layers`` (packed weights, the kernels
        built, float32 KV)."""
        st = self.state
        if not st.model.fused_layers:
            return False
        if any(s.params.exact for s in seqs):
            self.enable_exact()
        return self.rows_ok()

    def rows_ok(self) -> bool:
        st = self.state
        m, d = st.model, st.dmtd
        groups = [(0, d.thinking_start), (d.thinking_start, d.decoding_start), (d.decoding_start, d.num_layers)]
        if any(a < b and m.rows_args(st.weights, st.kv, a, b) is None for a, b in groups):
            return False
        if st.verify_kv is None:
            return True
        return m.rows_args(st.verify_weights, st.verify_kv, d.decoding_start, d.num_layers) is not None

    def _prefill_rows(self, seqs: list[Sequence], rows: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """The prompt positions ``rows`` of several sequences as the rows of one pass per layer group; the output
        [1, H] of each sequence's last row."""
        st = self.state
        m, d, dev = st.model, st.dmtd, st.device
        st.cache.sync()
        order = sorted(rows)
        ids = [t for i in order for t in seqs[i].token_ids[rows[i][0]: rows[i][1]]]
        pos = torch.tensor([p for i in order for p in range(*rows[i])], device=dev)
        kv_rows = torch.tensor([seqs[i].kv_row for i in order for _ in range(*rows[i])], device=dev)
        owner = torch.tensor([k for k, i in enumerate(order) for _ in range(*rows[i])], device=dev)
        # a prompt's positions, not a resumed sequence's own tokens (those keep the bits their decode step gave them)
        prompt = torch.tensor([p < seqs[i].prompt_len for i in order for p in range(*rows[i])], device=dev)

        def ctx_of(keep: torch.Tensor | slice) -> StepContext:  # rows_layers reads the rows' cache rows and positions
            return st.rows_context(kv_rows[keep], pos[keep], prompt[keep])

        ctx = ctx_of(slice(None))
        x = m.embed_tokens(torch.tensor([ids], device=dev)).to(st.act_dtype)
        h_enc = m.run_rows(x, 0, d.thinking_start, st.kv, ctx, st.weights)
        h_think = m.run_rows(h_enc, d.thinking_start, d.decoding_start, st.kv, ctx, st.weights)
        head = torch.cat([self.head_mask(seqs[i], torch.arange(*rows[i], device=dev)) for i in order])[None]
        exact = [k for k, i in enumerate(order) if seqs[i].params.exact]
        keep = torch.isin(owner, torch.tensor(exact, dtype=torch.long, device=dev))
        late = [k for k in exact if seqs[order[k]].prefill_end == seqs[order[k]].num_tokens]  # first token due
        h = self.variant_decoding_rows(route_decoding_input(h_enc, h_think, head, d.head_input),
                                       torch.isin(owner, torch.tensor(late, dtype=torch.long, device=dev)),
                                       [seqs[order[k]] for k in late], len(late) < len(exact), ctx_of,
                                       [seqs[i].variant for i in order for _ in range(*rows[i])])
        if exact:  # the verifying path over the exact sequences' rows: its outputs are theirs
            assert st.verify_kv is not None
            xv = route_decoding_input(h_enc[:, keep], h_think[:, keep], torch.ones_like(head[:, keep]),
                                      st.verifier.head_input)
            h = h.clone()
            h[:, keep] = m.run_rows(xv, d.decoding_start, d.num_layers, st.verify_kv, ctx_of(keep),
                                    st.verify_weights)
        ends = torch.cumsum(torch.tensor([rows[i][1] - rows[i][0] for i in order]), 0) - 1
        return {i: h[:, int(ends[k])] for k, i in enumerate(order)}

    def _prefill_chunk(self, s: Sequence, start: int, end: int) -> torch.Tensor:
        """Positions ``start .. end - 1`` of one prompt through every layer (and the verifying path's decoding
        group, for an exact request); the last layer's output [1, end - start, H]."""
        st = self.state
        m, d = st.model, st.dmtd
        ids = torch.tensor([s.token_ids[start:end]], device=st.device)
        pos = torch.arange(start, end, device=st.device)[None]
        ctx = st.context([s.kv_row], pos, None)
        h_enc = m.run_layers(m.embed_tokens(ids).to(st.act_dtype), 0, d.thinking_start, ctx.cos, ctx.sin,
                             st.kv, ctx, st.weights)
        h_think = m.run_layers(h_enc, d.thinking_start, d.decoding_start, ctx.cos, ctx.sin, st.kv, ctx,
                               st.weights)
        head = self.head_mask(s, pos[0])[None]
        x = route_decoding_input(h_enc, h_think, head, d.head_input)
        # The decoding group must still write KV for every prompt position; logits only for the last.
        h = m.run_layers(x, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, st.kv, ctx,
                         st.weights_of(s.variant))
        if s.params.exact:  # verified cycles: the prompt through the verifying path too; its logits are the output
            self.enable_exact()
            xv = route_decoding_input(h_enc, h_think, torch.ones_like(head), st.verifier.head_input)
            h = m.run_layers(xv, d.decoding_start, d.num_layers, ctx.cos, ctx.sin, st.verify_kv, ctx,
                             st.verify_weights)
        return h
