"""Engine configuration: the model architecture, the DMTD routing of a variant, and the runtime limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dmtd_contract.variant_schema import HEAD_INPUTS, PHASE_ANCHORS, HeadInput, PhaseAnchor

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mtpqwen3")


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field and the rule."""


@dataclass(slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers v4 or v5 layout)."""
        model_type = str(d.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if scaling is None and rope_type not in (None, "default"):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])
        is_qwen = model_type.startswith(("qwen", "mtpqwen"))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=is_qwen and model_type != "qwen2",
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def layer_bytes(cfg: ModelConfig, elem: int = 4) -> int:
    """Weight bytes of one decoder layer (projections and norms) at ``elem`` bytes per value."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return (params + 2 * cfg.hidden_size) * elem


def lm_head_bytes(cfg: ModelConfig, elem: int = 4) -> int:
    return cfg.vocab_size * cfg.hidden_size * elem


@dataclass(slots=True)
class DMTDConfig:
    """Layer split and routing conventions of a DMTD variant (docs/design.md §1).

    ``num_encoding_layers`` (E) + ``num_thinking_layers`` (T) + ``num_decoding_layers`` (D) = L.
    A head position runs all layers; a tail runs the encoding and decoding layers only and has its
    thinking-layer KV refilled at the next head.
    """

    num_encoding_layers: int
    num_thinking_layers: int
    num_decoding_layers: int
    tau_max: int = 4
    phase_anchor: PhaseAnchor = "prompt_end"
    head_input: HeadInput = "replace"

    def __post_init__(self) -> None:
        if self.num_encoding_layers < 0:
            raise ConfigError(f"num_encoding_layers must be >= 0, got {self.num_encoding_layers}")
        if self.num_thinking_layers < 1:
            raise ConfigError(f"num_thinking_layers must be >= 1, got {self.num_thinking_layers}")
        if self.num_decoding_layers < 1:
            raise ConfigError(f"num_decoding_layers must be >= 1, got {self.num_decoding_layers}")
        if self.tau_max < 1:
            raise ConfigError(f"tau_max must be >= 1, got {self.tau_max}")
        if self.phase_anchor not in PHASE_ANCHORS:
            raise ConfigError(f"phase_anchor must be 'prompt_end' or 'absolute', got {self.phase_anchor!r}")
        if self.head_input not in HEAD_INPUTS:
            raise ConfigError(f"head_input must be 'residual_add' or 'replace', got {self.head_input!r}")

    @property
    def num_layers(self) -> int:
        return self.num_encoding_layers + self.num_thinking_layers + self.num_decoding_layers

    @property
    def thinking_start(self) -> int:
        return self.num_encoding_layers

    @property
    def decoding_start(self) -> int:
        return self.num_encoding_layers + self.num_thinking_layers

    def check_model(self, model: ModelConfig) -> None:
        if self.num_layers != model.num_layers:
            raise ConfigError(
                f"layer split E+T+D = {self.num_encoding_layers}+{self.num_thinking_layers}+"
                f"{self.num_decoding_layers} = {self.num_layers} must equal the model's "
                f"num_hidden_layers ({model.num_layers})"
            )

    @classmethod
    def plain(cls, num_layers: int, num_decoding_layers: int = 1, tau_max: int = 1) -> DMTDConfig:
        """Routing for a base model without DMTD training: ``replace`` heads, so τ=1 is the base model."""
        if not 1 <= num_decoding_layers < num_layers:
            raise ConfigError(
                f"decoding_layers must be in 1..{num_layers - 1} for a {num_layers}-layer model, "
                f"got {num_decoding_layers}"
            )
        return cls(0, num_layers - num_decoding_layers, num_decoding_layers, tau_max, "prompt_end", "replace")

    def first_head_after_prompt(self, prompt_len: int, tau: int) -> tuple[bool, int]:
        """Whether the last prompt position is a head, and the next head position after it."""
        last = prompt_len - 1
        if self.phase_anchor == "prompt_end":
            return True, last + tau
        return last % tau == 0, (last // tau + 1) * tau

    def next_head(self, head_pos: int, tau: int) -> int:
        """The next scheduled head after a head at ``head_pos`` with cycle length ``tau``."""
        if self.phase_anchor == "absolute" and head_pos % tau == 0:
            return head_pos + tau
        if self.phase_anchor == "absolute":
            return (head_pos // tau + 1) * tau
        return head_pos + tau


@dataclass(slots=True)
class EngineConfig:
    """Runtime limits of one engine instance."""

    max_num_seqs: int = 16
    max_model_len: int = 2048
    device: str = "cpu"
    dtype: str = "float32"
    quant: str = "none"  # weight-only low-bit projections: "none", "int8" or "int4" (dmtd.engine.lowbit)
    max_prefill_tokens: int = 4096  # prompt positions a prefill step computes while no sequence decodes
    # prompts are prefilled in chunks of this many positions (boundaries at its multiples from position 0; where
    # prompts run as rows, a chunk is only what prefix caching reuses whole); while sequences decode, a step
    # prefills at most this many — or, as rows, what fits prefill_pace
    prefill_chunk: int = 128
    # while sequences decode, a prefill step (prompts as rows) takes about this many times a decode step's time
    # (dmtd.engine.prefill_pacer; a running stream's gaps stay near 1 + prefill_pace of its steady ones); 0: a
    # whole chunk of prefill_chunk positions each time
    prefill_pace: float = 1.0
    # where prompts run as rows: a prompt of at most this many positions is prefilled whole at the next step while
    # others decode (their streams take the gap, as vLLM's chunked prefill takes a prompt within its step's budget);
    # a longer one is paced (prefill_pace). 0: every prompt is paced
    long_prefill_tokens: int = 2048
    prefix_caching: bool = True  # a prompt's leading chunks found in the cache are reused (dmtd.engine.prefix_cache)
    # the KV cache is one pool of pages of page_size positions (dmtd.engine.kv_pages; with prefix caching, a divisor
    # of prefill_chunk: gcd(page_size, prefill_chunk)); a sequence holds the pages of the positions it has written.
    # kv_cache_tokens: the pool's positions (None: max_num_seqs × max_model_len, room for every sequence at full
    # length); kv_cache_gib sizes it by memory instead (every layer group's KV, the verifier's and the tail path's
    # stash counted)
    page_size: int = 16
    # the KV cache's element (vLLM's --kv-cache-dtype): "auto" keeps a bfloat16 model's keys and values in float32
    # (today's default); "bfloat16" stores them rounded once as written — half the pool's bytes and attention's
    # reads — where dmtd::attend computes every row's attention on the CPU (kernels built, not the amx path: its
    # prompt rows read a float32 cache); "float32" pins float32
    kv_cache_dtype: str = "auto"
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    align_phases: bool = True  # heads of all rows on shared decode steps (prompt_end variants)
    adaptive_drafts: bool = False  # exact profile: draft the length with the most expected tokens per cost
    # with adaptive_drafts: drafts run at a batch size only while they measured more tokens per row-second there
    # than plain base steps (dmtd.engine.draft_gate); off: the per-row policy alone decides
    batch_gate: bool = True
    # exact profile: when most exact rows of a step check their drafts, the rest check theirs too (cut short, or a
    # plain token where they have none yet): the check pass reads every weight anyway, and the rows' cycles go on in
    # phase — one check pass a cycle for the batch, not one every step for whichever row is due
    align_checks: bool = True
    # exact profile: the drafts' weights. "int8": int8 × int8 dot products (dmtd.engine.lowbit's i8dot, ~2x
    # faster than bf16 at one row); "none": the engine's own; "auto": int8 where this CPU has AVX512-VNNI or AVX2
    draft_quant: str = "auto"
    # exact profile, greedy requests: drafts also score the ids of their own context (prompt, answer so far) that a
    # restricted draft vocabulary lacks (dmtd.engine.runner.ModelRunner._draft_logits)
    context_vocab: bool = True
    # exact profile with adaptive drafts, greedy requests: a cycle may check the tokens that followed an earlier
    # occurrence of the context's last few tokens instead of the tails' drafts, where the policy expects more of it
    # (dmtd.engine.llm.LLMEngine._context_drafts)
    context_drafts: bool = True
    # with context_drafts: the variant's phrase table (dmtd.engine.phrase_table) is one more such source
    phrase_drafts: bool = True
    # exact profile, prompts as rows: the variant's decoding group over an exact prompt (the KV its drafts read, not
    # its output) runs at the start of the next step, after the prompt's first token is out (~a fifth of an exact
    # prefill's layers; dmtd.engine.prefill.PrefillRunner.catch_up)
    draft_kv_after_first_token: bool = True

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.long_prefill_tokens < 0:
            raise ConfigError(f"long_prefill_tokens must be >= 0, got {self.long_prefill_tokens}")
        if not (self.prefill_pace >= 0 and math.isfinite(self.prefill_pace)):
            raise ConfigError(f"prefill_pace must be a finite number >= 0, got {self.prefill_pace}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ConfigError(f"kv_cache_tokens must be at least one page ({self.page_size}), got "
                              f"{self.kv_cache_tokens}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"dtype must be float32, bfloat16, float16 or float64, got {self.dtype!r}")
        if self.quant not in ("none", "int8", "int4"):
            raise ConfigError(f"quant must be none, int8 or int4, got {self.quant!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.draft_quant not in ("auto", "none", "int8"):
            raise ConfigError(f"draft_quant must be auto, none or int8, got {self.draft_quant!r}")
        if self.quant != "none" and self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"quant {self.quant!r} needs dtype float32 or bfloat16, got {self.dtype!r}")
