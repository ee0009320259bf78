"""The serving configuration, one typed model with one set of defaults.

* ``EngineSettings``: a replica's engine (sequences, context, KV pool, queue, drafts, precision). The CRD's
  ``spec.engine`` is this model under camelCase names (``dmtd_operator.spec.Engine``), so the chart and the
  operator take their defaults and rules from here.
* ``VariantArgs``: one served variant, and its overrides of the engine settings.
* ``ServeConfig``: the arguments of the Serve application (``dmtd.serve.app:build_app``): what ``dmtd serve``
  passes, what the operator writes into the RayService's serveConfigV2, what KubeRay hands the builder.

``ServeConfig.parse`` validates a dict of arguments and raises ``ServeConfigError`` naming the field and its
rule. A blank value (None or "") of a field means its default (``worker_niceness: None`` means Ray's own).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Dtype = Literal["auto", "float32", "bfloat16"]
Quant = Literal["none", "int8", "int4"]
Drafts = Literal["adaptive", "fixed"]
Routing = Literal["prefix", "pow2"]
OmpWaitPolicy = Literal["PASSIVE", "ACTIVE"]

DEFAULT_STREAM_INTERVAL_MS = 40.0
# the gateway's own HTTP server's port where `dmtd serve` names none (ServeConfig.http_port None: no such server)
DEFAULT_HTTP_PORT = 8000


class ServeConfigError(ValueError):
    """A serving setting out of its rule; the message names the field (``max_num_seqs: ...``)."""


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _truth(field: str, value: Any) -> Any:
    """A bool, or ``true`` / ``false`` as text (any case): the one spelling of a switch in every config."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"{field}: must be true or false, got {value!r}")
    return text == "true"


def _drop_blanks(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: v for k, v in data.items() if not _blank(v)}
    return data


class _Settings(BaseModel):
    """Blank values are the defaults; the draft switches read ``true`` / ``false`` in any case."""

    @model_validator(mode="before")
    @classmethod
    def _blanks_are_defaults(cls, data: Any) -> Any:
        return _drop_blanks(data)

    @field_validator("context_drafts", "phrase_drafts", mode="before", check_fields=False)
    @classmethod
    def _switch(cls, value: Any, info: Any) -> Any:
        return _truth(info.field_name, value)


class EngineSettings(_Settings):
    """A replica's engine: how many sequences of what length it runs, its KV pool, its queue and its drafts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Sequences a replica runs at once.")
    max_model_len: int = Field(default=8192, ge=2, le=1 << 20,
                               description="A sequence's positions at most (prompt + answer).")
    kv_cache_tokens: int = Field(
        default=32768, ge=16,
        description="Positions of a replica's KV pool, shared by its sequences in pages of 16 (the bytes that 16 "
        "fixed slots of 2,048 positions held); never more than every sequence at full length.")
    kv_cache_gib: float | None = Field(default=None, gt=0, description="Size the KV pool by memory instead (GiB).")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="The KV cache's element (vLLM's --kv-cache-dtype): auto keeps a bfloat16 model's "
        "keys and values in float32; bfloat16 stores them rounded once (half the pool's bytes a position) where the "
        "CPU kernels compute attention (not on the amx path); the exact profile stays the base model's at that cache.")
    max_queued: int = Field(default=64, ge=0, le=100000,
                            description="Requests a replica holds waiting beyond those it runs, before it refuses.")
    itl_slo_ms: float = Field(default=50.0, gt=0, description="Per-token ITL the replica's τ controller aims at.")
    prefill_pace: float = Field(
        default=1.0, ge=0, le=100, allow_inf_nan=False,
        description="Prefill work a step while other sequences decode, in decode steps' time (riding on the exact "
        "profile's check passes): running streams' gaps stay near 1 + this; higher gives new prompts their first "
        "token sooner. 0: whole chunks of 128 positions between decode steps.")
    long_prefill_tokens: int = Field(
        default=2048, ge=0, le=1 << 20,
        description="A prompt of at most this many tokens is prefilled whole at the next step while others decode "
        "(their streams take the gap, for the prompt's first token sooner); a longer one is paced (prefill_pace). "
        "0: every prompt is paced.")
    dtype: Dtype | None = Field(
        default=None, description="Weights and activations (default: the variant's recommendation, else auto: "
        "bfloat16 on a CPU with AVX-512 or AVX2).")
    quant: Quant | None = Field(
        default=None, description="Weight-only quantisation (default: the variant's recommendation, else none).")
    drafts: Drafts = Field(
        default="adaptive", description="How exact requests draft: 'adaptive' (the count that pays, none where "
        "none does) or 'fixed' (up to τ − 1 a cycle, stopping at the gate).")
    context_drafts: bool = Field(
        default=True, description="Exact greedy requests may check the context's own continuation (prompt lookup) "
        "instead of the tails' drafts, where that pays.")
    phrase_drafts: bool = Field(
        default=True, description="With context drafts: the variant's phrase table is one more draft source.")

    def pool_tokens(self) -> int | None:
        """The KV pool's positions (None: sized by ``kv_cache_gib``)."""
        return None if self.kv_cache_gib else min(self.kv_cache_tokens, self.max_num_seqs * self.max_model_len)


ENGINE_FIELDS: tuple[str, ...] = tuple(EngineSettings.model_fields)
# the engine settings a variant may set for itself (the others are the replica deployment's)
VARIANT_ENGINE_FIELDS = ("dtype", "quant", "drafts", "context_drafts", "phrase_drafts")


class VariantArgs(_Settings):
    """One served variant: what its replicas load and its share of the unnamed requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The name requests route by.")
    variant: str | None = Field(
        default=None, description="Variant to load (a shipped name or a manifest path); 'none': the plain base "
        "model; default: the name.")
    model: str | None = Field(
        default=None, validation_alias=AliasChoices("model", "model_uri"),
        description="Base model: 'smollm2' (the embedded default) or a local HF directory.")
    decoding_layers: int | None = Field(
        default=None, ge=1, description="With variant 'none': run the base model with DMTD routing and this many "
        "decoding layers.")
    load_format: Literal["auto", "dummy"] | None = Field(
        default=None, description="'dummy' (vLLM's spelling): the model's config and tokenizer, seeded random "
        "weights (a shape without its weights); default: env DMTD_LOAD_FORMAT, else 'auto' (its safetensors).")
    weight: float = Field(default=1.0, ge=0, description="Traffic weight among the active variants (relative).")
    replicas: int | None = Field(default=None, ge=0, le=1000,
                                 description="Replicas of this variant (default: the app's).")
    tau_max: int | None = Field(default=None, ge=1, le=16, description="Cap on the variant's own τ max.")
    tails: list[str] = Field(
        default_factory=list, description="More variants its replicas serve beside it, over the same trunk (base "
        "model and layer split): shipped names or manifest paths. Requests name each by its manifest name; they share "
        "the replica's steps and prefix cache. With a registry, every active variant of the trunk is served too.")
    dtype: Dtype | None = None
    quant: Quant | None = None
    drafts: Drafts | None = None
    context_drafts: bool | None = None
    phrase_drafts: bool | None = None

    @property
    def loads(self) -> str:
        """The variant its replicas load."""
        return self.variant or self.name


def _niceness(field: str, value: Any) -> int:
    text = str(value).strip()
    if not text.lstrip("-").isdigit() or not -20 <= int(text) <= 19:
        raise ValueError(f"{field}: must be a nice value in -20..19 (or 'ray' for Ray's own), got {value!r}")
    return int(text)


class ServeConfig(EngineSettings):
    """The Serve application's arguments. The engine settings apply to every variant's replicas (a variant may
    override ``VARIANT_ENGINE_FIELDS``); any ``TelemetrySettings`` field (``deployment``, ``metrics_port``,
    ``trace_exporter`` …) may also stand at top level, and the serving side checks those names."""

    model_config = ConfigDict(extra="allow", frozen=True)

    variants: list[VariantArgs] = Field(default_factory=lambda: [VariantArgs(name="default", variant="none")],
                                        min_length=1, description="The served variants.")
    default: str | None = Field(
        default=None, description="The variant unnamed requests fall back to (default: the first).")
    replicas: int = Field(default=1, ge=0, le=1000,
                          description="Replicas of each variant (a variant may set its own).")
    max_variants: int = Field(
        default=8, ge=1, le=256, description="Variants a replica holds at most, its own included: loading one more "
        "lets the least recently used idle one go (a variant with requests in flight is never let go).")
    routing: Routing = Field(
        default="prefix", description="Several replicas: 'prefix' sends a request to the replica likeliest to hold "
        "its prompt's prefix (load first); 'pow2' is Serve's default.")
    replica_num_cpus: float = Field(
        default=1.0, ge=0, description="CPUs Ray reserves for a replica; with several replicas also their torch "
        "threads.")
    torch_threads: int = Field(
        default=0, ge=0, description="A replica's torch threads (0: env DMTD_TORCH_THREADS, else replica_num_cpus "
        "with several replicas, else every core).")
    namespace: str | None = Field(default=None, description="The DMTDDeployment's Kubernetes namespace (the "
                                  "operator sets it; informational).")
    grpc_host: str = Field(default="127.0.0.1",
                           description="Address the gateway's gRPC server binds (0.0.0.0 on Kubernetes).")
    grpc_port: int = Field(default=9000, ge=0, le=65535, description="The gateway's gRPC port.")
    http_host: str | None = Field(default=None, description="Address the gateway's own HTTP server binds (default: "
                                  "grpc_host).")
    http_port: int | None = Field(
        default=None, ge=0, le=65535, description="The gateway's own HTTP server: the OpenAI API and the dashboard "
        "served in the gateway's process, each streamed chunk written to the client's socket there (None: HTTP only "
        "through Serve's proxy, a Ray call's item per chunk; `dmtd serve` gives DEFAULT_HTTP_PORT).")
    max_inflight: int = Field(default=64, ge=1, description="Requests the gateway admits at once.")
    registry_url: str | None = Field(default=None,
                                     description="Redis URL of the variant registry the stack follows.")
    limits: dict[str, Any] = Field(
        default_factory=dict, description="Request size limits (dmtd.serve.requests.Limits fields), checked at the "
        "gateway and the replicas.")
    telemetry: dict[str, Any] = Field(default_factory=dict, description="TelemetrySettings fields.")
    api_keys_file: str | None = Field(
        default=None, description="File of API keys, one a line (also env DMTD_API_KEYS).")
    tls_cert_file: str | None = Field(default=None, description="PEM certificate of the gateway's gRPC server.")
    tls_key_file: str | None = Field(default=None, description="PEM private key of tls_cert_file.")
    gateway_resources: dict[str, float] | None = Field(
        default=None, description="Ray resources that pin the gateway (on Kubernetes: the head pod's).")
    block_push: str = Field(
        default="auto", description="Where the gateway's block sink listens, which replicas push blocks to: 'auto' "
        "(loopback when grpc_host is, else the node's address), an IP address, or 'off' (blocks travel as items "
        "of the Serve call).")
    stream_interval_ms: float = Field(
        default=DEFAULT_STREAM_INTERVAL_MS, ge=0, le=1000, allow_inf_nan=False,
        description="Blocks travelling as Serve items: a replica gathers a request's blocks ready within this "
        "interval into one item (0: each alone).")
    worker_niceness: int | Literal["ray"] = Field(
        default=0, description="Nice value of the gateway's and replicas' processes; 'ray' (or None) keeps Ray's 15.")
    gateway_niceness: int | None = Field(default=None, description="The gateway's own nice value.")
    serve_user_thread: bool = Field(
        default=False, description="True: Serve's default, our code on a thread of its own; False saves a thread "
        "hop per streamed item.")
    router_thread: bool = Field(
        default=False, description="True: Serve's default, the gateway's handles route on a loop of their own.")
    omp_wait_policy: OmpWaitPolicy | None = Field(
        default=None, description="OMP_WAIT_POLICY of the replicas (default: OpenMP's own); PASSIVE suits a replica "
        "sharing its cores.")
    omp_spin_count: int | None = Field(
        default=None, ge=0, description="GOMP_SPINCOUNT of the replicas (ignored with omp_wait_policy; default: "
        "the runtime's own).")

    @model_validator(mode="before")
    @classmethod
    def _blanks_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "worker_niceness" in data and data["worker_niceness"] is None:
            data = {**data, "worker_niceness": "ray"}
        return _drop_blanks(data)

    @field_validator("worker_niceness", "gateway_niceness", mode="before")
    @classmethod
    def _nice(cls, value: Any, info: Any) -> Any:
        return value if value == "ray" else _niceness(info.field_name, value)

    @field_validator("serve_user_thread", "router_thread", mode="before")
    @classmethod
    def _thread_switch(cls, value: Any, info: Any) -> Any:
        return _truth(info.field_name, value)

    @field_validator("omp_wait_policy", mode="before")
    @classmethod
    def _policy(cls, value: Any) -> Any:
        text = str(value).strip().upper()
        if text not in ("PASSIVE", "ACTIVE"):
            raise ValueError(f"omp_wait_policy: must be PASSIVE, ACTIVE or empty, got {value!r}")
        return text

    @field_validator("omp_spin_count", mode="before")
    @classmethod
    def _spins(cls, value: Any) -> Any:
        if value == "openmp":
            return None
        if not str(value).strip().isdigit():
            raise ValueError(f"omp_spin_count: must be a whole number of spins, 'openmp' or empty, got {value!r}")
        return int(str(value).strip())

    @field_validator("block_push", mode="before")
    @classmethod
    def _push(cls, value: Any) -> Any:
        text = str(value).strip()
        if text.lower() in ("auto", "off"):
            return text.lower()
        try:
            ipaddress.ip_address(text.strip("[]"))
        except ValueError:
            raise ValueError(f"block_push: must be 'auto', 'off' or an IP address to listen on, got {value!r}") \
                from None
        return text

    @model_validator(mode="after")
    def _distinct_variants(self) -> Self:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variants: names must be unique, got {names}")
        return self

    @classmethod
    def parse(cls, args: Mapping[str, Any]) -> ServeConfig:
        """``args`` validated; ``ServeConfigError`` naming each bad field and its rule."""
        try:
            return cls.model_validate(dict(args))
        except ValidationError as e:
            raise ServeConfigError(describe(e)) from None

    def engine(self, variant: VariantArgs) -> EngineSettings:
        """The engine settings of ``variant``'s replicas: the app's, with the variant's own overrides."""
        own = {k: getattr(variant, k) for k in VARIANT_ENGINE_FIELDS if getattr(variant, k) is not None}
        return EngineSettings.model_validate({**{k: getattr(self, k) for k in ENGINE_FIELDS}, **own})

    def replicas_of(self, variant: VariantArgs) -> int:
        return self.replicas if variant.replicas is None else variant.replicas


def describe(error: ValidationError) -> str:
    """One line per bad field: ``field: rule, got value`` (a validator's own message already names its field)."""
    lines = []
    for err in error.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "value_error":
            text = str(err["ctx"]["error"])
            named = not err["loc"] or text.startswith(f"{err['loc'][-1]}:")  # a model rule names its own fields
            lines.append(text if named else f"{where}: {text}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"{where}: not a setting")
        else:
            msg = err["msg"][0].lower() + err["msg"][1:]
            lines.append(f"{where}: {msg}, got {err['input']!r}")
    return "; ".join(lines)
