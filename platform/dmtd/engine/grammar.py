"""Grammars a request's output must match (structured outputs), through llguidance.

llguidance (the grammar engine vLLM and SGLang use; a Rust library, CPU, no torch dependency) turns a grammar —
JSON schema, regex, Lark, all compiled by the gateway into its JSON form — and the tokenizer into a per-request
matcher that yields the set of allowed next tokens as a bitmask. Chosen over xgrammar (docs/serving.md, "The
OpenAI API"; ``scripts/grammar_mask_cost.py``): a schema compiles in ~1 ms against xgrammar's ~50 ms (paid before a
new schema's first token); either mask (~0.04 ms a token; xgrammar's ~0.003 ms) is under 1 % of a step; and its
wheel needs nothing else (xgrammar's requires torch, triton and apache-tvm-ffi).
"""

from __future__ import annotations

from typing import Any

import torch

from dmtd.engine.sequence import RequestError


class GrammarCompiler:
    """The tokenizer's llguidance form (built once, ~0.3 s) and the matchers of requests' grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        if tokenizer is None:
            raise RequestError("response_format", "this engine has no tokenizer to apply a grammar with")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar`` (llguidance's JSON grammar form); a bad grammar names ``response_format``."""
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RequestError("response_format", f"invalid grammar: {m.get_error()[:300]}")
        return m

    def allowed(self, matcher: Any, drafts: list[int], rows: int) -> torch.Tensor:
        """Allowed tokens [rows, words·32] (bool): row j after ``drafts[:j]``. From the first draft the grammar
        forbids on, the rows allow everything (they follow an impossible prefix: the check never reaches them).
        The matcher's state is left as it was."""
        bm = torch.full((rows, self.words), -1, dtype=torch.int32)
        consumed = 0
        for j in range(rows):
            if j == consumed:  # (llguidance.torch's helper does this; importing it costs a torch.compile, ~1 s)
                matcher.unsafe_compute_mask_ptr(bm[j].data_ptr(), self.words * 4)
            if j < rows - 1 and j == consumed and matcher.try_consume_tokens([drafts[j]]) == 1:
                consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return ((bm[:, :, None] >> self._bits) & 1).bool().reshape(rows, -1)

