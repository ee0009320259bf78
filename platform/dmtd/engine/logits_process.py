"""A request's own shaping of the logits its tokens are drawn from, and the log-probabilities of those tokens.

Shaping, in this order: ``min_tokens`` (EOS, unless ``ignore_eos``, and the stop tokens forbidden while the output
is shorter; vLLM's), ``repetition_penalty`` (every prompt and output token: a positive logit divided by it, a
negative one multiplied), ``frequency_penalty`` × count and ``presence_penalty`` (output tokens), ``logit_bias``
(added), then the grammar's mask (``dmtd.engine.grammar``; forbidden tokens -inf). It applies wherever a request's
token is drawn: the rows of plain steps and every row of a verified cycle's check, where row j sees the drafts
before it as output and the grammar's state after them. The exact profile then reproduces the shaped base model:
a greedy draft is accepted only where it is the shaped argmax; a draft the grammar forbids has probability 0, so
the check rejects it and the drafts end there.

Log-probabilities (``SamplingParams.logprobs``) are those of the shaped distribution at temperature 1, before
top-k / top-p: for an exact request, the verifier's row, never a draft's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dmtd.engine.draft_sources import FORCED as FORCED_SOURCE  # the draft source of a grammar's forced tokens
from dmtd.engine.outputs import TokenLogprob
from dmtd.engine.sequence import RequestError, SamplingParams, Sequence


@dataclass(slots=True)
class _Shape:
    """One request's shaping state: its grammar's matcher and the log-probabilities of drawn, not yet emitted
    tokens (in the order their events come)."""

    matcher: Any = None
    queued: deque[TokenLogprob] = field(default_factory=deque)


def _shapes_throughout(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                or p.grammar is not None)


def shapes(p: SamplingParams) -> bool:
    """Whether a request's rows need shaping at all (plain requests pay nothing)."""
    return _shapes_throughout(p) or p.min_tokens > 0


def shapes_now(seq: Sequence) -> bool:
    """Whether a sequence's next rows need shaping (``min_tokens`` alone: only until the output reaches it)."""
    return _shapes_throughout(seq.params) or seq.params.min_tokens > seq.num_generated


class LogitsShaper:
    """Per-request shaping and log-probabilities for one engine (``tokenizer``: for grammars and token bytes)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int] | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = eos_ids or set()  # what min_tokens forbids besides a request's stop tokens
        self.states: dict[str, _Shape] = {}
        self._grammars: Any = None  # dmtd.engine.grammar.GrammarCompiler, made on the first grammar
        self._bytes: list[bytes] | None = None

    def add(self, req_id: str, p: SamplingParams) -> None:
        """Take a request on (raises :class:`RequestError` naming the field for a bad bias or grammar)."""
        if not (shapes(p) or p.logprobs is not None):
            return
        bad = [t for t in p.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError("logit_bias", f"token ids must be in 0..{self.vocab_size - 1}, got {bad[0]}")
        st = _Shape()
        if p.grammar is not None:
            if self._grammars is None:
                from dmtd.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            st.matcher = self._grammars.matcher(p.grammar)
        if p.logprobs is not None and self._bytes is None:
            self._bytes = token_bytes(self.tokenizer, self.vocab_size)
        self.states[req_id] = st

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Shape the rows [B, V] of a plain step (one row per sequence, its next token); unshaped rows as given."""
        idx = [i for i, s in enumerate(seqs) if s.req_id in self.states and shapes_now(s)]
        if not idx:
            return logits
        out = logits.float().clone()
        for i in idx:
            out[i: i + 1] = self._shape(out[i: i + 1], seqs[i], [])
        return out

    def check_rows(self, logits: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, int]:
        """A check's rows [m + 1, V] shaped, and how many of the drafts to check: with a grammar, up to and
        including the first one it forbids (its row's mask rejects it; the rows after it are never reached)."""
        m = len(seq.draft.tokens)
        st = self.states.get(seq.req_id)
        if st is None or not shapes_now(seq):
            return logits, m
        if st.matcher is not None:
            m = min(m, st.matcher.validate_tokens(seq.draft.tokens) + 1)
        return self._shape(logits[: m + 1].float().clone(), seq, seq.draft.tokens[:m]), m

    def _shape(self, x: torch.Tensor, seq: Sequence, drafts: list[int]) -> torch.Tensor:
        """Rows [r, V] in place: row j follows the output so far plus ``drafts[:j]``."""
        p, r, V = seq.params, x.shape[0], x.shape[-1]
        dev = x.device
        early = min(r, p.min_tokens - seq.num_generated)  # rows whose token would end the output too soon
        if early > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
            ids = torch.tensor(sorted(t for t in stops if 0 <= t < V), dtype=torch.long, device=dev)
            x[:early, ids] = float("-inf")
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            out_ids = torch.tensor(seq.generated_ids + drafts[: r - 1], dtype=torch.long, device=dev)
            n_out = len(seq.generated_ids)
            counts = torch.zeros(r, V, device=dev)
            if n_out:
                counts += torch.bincount(out_ids[:n_out], minlength=V)[:V].float()
            for j in range(1, r):  # row j has drafts[:j] behind it
                counts[j:, drafts[j - 1]] += 1
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[:, torch.tensor(seq.token_ids[: seq.prompt_len], dtype=torch.long, device=dev)] = True
                x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            x[:, ids] += torch.tensor(list(p.logit_bias.values()), device=dev)
        matcher = self.states[seq.req_id].matcher
        if matcher is not None:
            allowed = self._grammars.allowed(matcher, drafts[: r - 1], r).to(dev)
            x = x.masked_fill(~allowed[:, :V], float("-inf"))
        return x

    def record(self, req_id: str, params: SamplingParams, logits: torch.Tensor, tokens: list[int]) -> None:
        """The log-probabilities of ``tokens`` drawn from the shaped rows ``logits`` [len(tokens), V], queued for
        their events (``emitted``)."""
        st = self.states.get(req_id)
        if st is None or params.logprobs is None:
            return
        lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        top_v, top_i = (lp.topk(params.logprobs, dim=-1) if params.logprobs else (lp[:, :0], lp[:, :0].long()))
        assert self._bytes is not None
        b = self._bytes
        for t, c, vs, ids in zip(tokens, chosen, top_v.tolist(), top_i.tolist()):
            st.queued.append((t, b[t], c, [(i, b[i], v) for i, v in zip(ids, vs)]))

    def forced(self, req_id: str) -> list[int]:
        """The tokens the request's grammar forces from its state now (none without a grammar)."""
        st = self.states.get(req_id)
        return [] if st is None or st.matcher is None else list(st.matcher.compute_ff_tokens())

    def emitted(self, req_id: str, token_id: int) -> TokenLogprob | None:
        """A token event of this request: advance its grammar; its log-probability (None: none asked, or a tail
        token the gate dropped)."""
        st = self.states.get(req_id)
        if st is None:
            return None
        entry = st.queued.popleft() if st.queued else None
        if token_id < 0:
            return None
        if st.matcher is not None:
            st.matcher.consume_token(token_id)
        return entry if entry is not None and entry[0] == token_id else None


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token id's bytes: byte-level BPE pieces mapped back to bytes, other pieces (special tokens) as UTF-8."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size))) if tokenizer is not None else []
    out = []
    for t in range(vocab_size):
        piece = pieces[t] if t < len(pieces) and pieces[t] is not None else ""
        if piece and all(ch in decoder for ch in piece):
            out.append(bytes(decoder[ch] for ch in piece))
        else:
            out.append(piece.encode("utf-8"))
    return out


__all__ = ["FORCED_SOURCE", "LogitsShaper", "shapes", "shapes_now", "token_bytes"]
