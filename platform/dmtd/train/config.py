"""The training recipe's configuration (user-facing, pydantic; stored in every checkpoint and variant)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dmtd_contract.variant_schema import HeadInput, PhaseAnchor

# Fields a resumed run may change without breaking exactness of what was already trained (``cache``: its
# path may move; its content is checked against the checkpoint's cache hash).
RESUMABLE_CHANGES = ("max_steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_records", "threads",
                     "device", "cache")


class TrainConfig(BaseModel):
    """A cyclical-masking fine-tuning run (docs/design.md §1): routing, scope, loss and schedule."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("smollm2-dmtd", pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$", description="variant name")
    corpus: str = Field(description="corpus directory made by `dmtd data`")
    base_model: str = Field("smollm2", description="'smollm2' or a local HF directory")
    num_encoding_layers: int = Field(0, ge=0)
    num_decoding_layers: int = Field(8, ge=1)
    phase_anchor: PhaseAnchor = "prompt_end"
    head_input: HeadInput = "replace"
    tau_min: int = Field(2, ge=1, description="τ is drawn per sequence from tau_min..tau_max (equal = fixed τ)")
    tau_max: int = Field(4, ge=1, le=16)
    phase_jitter: bool = Field(True, description="draw the first cycle after the prompt from 1..τ, as the "
                               "engine's phase-aligned batches shorten it")
    scope: Literal["decoding", "all", "lora"] = Field("decoding", description="what trains: the decoding "
                                                      "layers, all layers, or LoRA adapters on lora_layers")
    lora_layers: str = Field("decoding", description="'decoding', 'all' or indices like '18-29'")
    lora_targets: list[str] = Field(default_factory=lambda: ["qkv", "o", "gate_up", "down"])
    lora_rank: int = Field(32, ge=1)
    lora_alpha: float = Field(64.0, gt=0)
    lora_train_norms: bool = Field(True, description="also train the RMSNorm weights of LoRA layers")
    temperatures: list[float] | None = Field(
        None, description="train only on the records sampled at these temperatures (e.g. 0: the greedy "
        "completions, the sequences a verified cycle checks its tails against); None = all records")
    kl_weight: float = Field(1.0, ge=0, description="KL(base ‖ student) self-distillation weight")
    ce_weight: float = Field(0.0, ge=0, description="cross-entropy on the corpus tokens")
    head_weight: float = Field(1.0, ge=0, description="loss weight of head positions")
    tail_weight: float = Field(1.0, ge=0, description="loss weight of tail positions")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(20, ge=0)
    max_steps: int = Field(1000, ge=1)
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    max_len: int = Field(384, ge=8, description="tokens per sequence (prompt + completion, truncated)")
    grad_clip: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    seed: int = 0
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    eval_every: int = Field(0, ge=0, description="steps between held-out agreement checks (0 = off)")
    eval_records: int = Field(16, ge=1)
    cache: str | None = Field(None, description="teacher cache directory made by `dmtd cache` (or 'auto': the "
                              "corpus's default one for this split and these temperatures): train from the cached "
                              "trunk states and top-k teacher targets; needs a frozen trunk (scope decoding)")
    init_from: str | None = Field(None, description="start from the trained tensors of this checkpoint, or of "
                                  "an exported variant directory (e.g. the shipped one: a run on a new machine "
                                  "goes on from it); optimizer and step start fresh")
    device: str | None = Field(None, description="'cpu', 'cuda', … (None = cuda when present); exact resume "
                               "holds on the same device")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch's default)")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the forward and backward passes' matmuls: bfloat16 runs them under autocast "
        "(master weights, optimizer state and the loss stay float32); on a CPU with AMX several times faster")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.tau_min > self.tau_max:
            raise ValueError(f"tau_min ({self.tau_min}) must be <= tau_max ({self.tau_max})")
        if self.kl_weight == 0 and self.ce_weight == 0:
            raise ValueError("kl_weight and ce_weight cannot both be 0")
        if self.cache is not None and self.scope != "decoding":
            raise ValueError(f"cache needs scope 'decoding' (a frozen trunk), not {self.scope!r}")
        if self.head_weight == 0 and self.tail_weight == 0:
            raise ValueError("head_weight and tail_weight cannot both be 0")
        return self

    def identity(self) -> dict[str, object]:
        """The fields a resume must match exactly."""
        return self.model_dump(exclude=set(RESUMABLE_CHANGES))
