"""The DMTDDeployment spec: what a user serves and the latency they promise.

The pydantic models are the single source of truth: the CRD's openAPIV3Schema is generated from them
(`dmtd_operator.crd`), and the operator parses every object through `DMTDDeploymentSpec`. Python names
are snake_case with unit suffixes; the Kubernetes names are their camelCase aliases
(`ttft_p95_ms` <-> `ttftP95Ms`).
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from dmtd_contract.serve_config import EngineSettings
from dmtd_operator import __version__

# The image `make images` builds and the chart runs (tagged with the chart's appVersion = this version).
SERVING_IMAGE = f"ghcr.io/dmtd/serving:{__version__}"

DEFAULT_TAU_SPEEDUP: tuple[float, ...] = (1.0, 1.35, 1.55, 1.7)
"""Relative tokens/s of one replica at tau = 1, 2, 3, 4 (replace with `dmtd bench serve` results)."""

DEFAULT_GRPC_SERVICERS: tuple[str, ...] = ("dmtd.v1.generate_pb2_grpc.add_GenerateServiceServicer_to_server",)
"""Where the serving side's generated gRPC stubs register the gateway servicer."""

MAX_TAU = 8
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _rules(*rules: tuple[str, str]) -> JsonDict:
    """CEL rules for the API server (`x-kubernetes-validations`); pydantic checks the same in Python."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": msg} for rule, msg in rules]}


class Variant(_Model):
    """One model variant served by the deployment and its share of the traffic."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="Variant id, unique in the deployment.")
    model_uri: str = Field(
        min_length=1,
        description="Where the replica loads the variant from (registry id, HF directory, GGUF path).",
    )
    weight: int = Field(
        default=100, ge=0, le=100, description="Traffic share in percent; weights sum to 100."
    )
    tails: list[str] = Field(
        default_factory=list, max_length=64,
        description="More variants its replicas serve beside it over the same trunk (base model and layer split), "
        "each by its own name: `registry://<id>` of a variant the image ships, or a manifest path. With the "
        "registry, every active variant of the trunk is served too (`dmtd variants register`).",
    )


class ReplicaBounds(_Model):
    """Replica count bounds; `min` may be 0 (the gateway holds requests during a cold start)."""

    model_config = ConfigDict(json_schema_extra=_rules(("self.min <= self.max", "min must be <= max")))

    min: int = Field(
        default=1, ge=0, le=1000, description="Floor of the replica count (0 allows scale to zero)."
    )
    max: int = Field(default=4, ge=1, le=1000, description="Ceiling of the replica count.")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) must be <= replicas.max ({self.max})")
        return self


class Resources(_Model):
    """Accelerators of one replica."""

    gpus_per_replica: int = Field(default=1, ge=0, le=16, description="GPUs per replica (0 = CPU replica).")
    gpu_type: str = Field(
        default="",
        max_length=128,
        description="GPU product label value to schedule on, e.g. NVIDIA-H100-80GB-HBM3; empty means any.",
    )


class Slo(_Model):
    """Latency objectives the operator scales to keep; they lead every decision."""

    ttft_p95_ms: float = Field(default=1000.0, gt=0, description="Time to first token, 95th percentile, ms.")
    itl_p95_ms: float = Field(
        default=50.0, gt=0, description="Per-token inter-token latency, 95th percentile, ms."
    )


class GpuUtilizationBounds(_Model):
    """Guardrail only: batching keeps utilisation near 100% at any load, so it never drives scale-up."""

    model_config = ConfigDict(json_schema_extra=_rules(("self.min < self.max", "min must be < max")))

    min: float = Field(
        default=0.3,
        ge=0,
        le=1,
        description="Below this the GPUs have idle gaps: a latency "
        "breach is not a capacity problem (no scale-up) and, well inside the SLOs, a replica is "
        "surplus.",
    )
    max: float = Field(
        default=0.95,
        ge=0,
        le=1,
        description="At or above this, scale-down removes one replica per decision at most.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min >= self.max:
            raise ValueError(f"gpuUtilization.min ({self.min}) must be < gpuUtilization.max ({self.max})")
        return self


class TauPolicy(_Model):
    """Bounds of the cycle length tau the replicas may use; wider tau = more tokens/s, slight quality cost."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.min <= self.baseline && self.baseline <= self.max", "need min <= baseline <= max")
        )
    )

    min: int = Field(default=1, ge=1, le=MAX_TAU, description="Lowest tau a replica may use.")
    baseline: int = Field(
        default=1,
        ge=1,
        le=MAX_TAU,
        description="Upper tau bound in force when there is no pressure; replicas are sized for this tau.",
    )
    max: int = Field(
        default=4,
        ge=1,
        le=MAX_TAU,
        description="Upper tau bound the operator may widen to under a burst while new replicas cold-start.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not self.min <= self.baseline <= self.max:
            raise ValueError(f"tau needs min <= baseline <= max, got {self.min}, {self.baseline}, {self.max}")
        return self


class Scaling(_Model):
    """How fast and how eagerly replicas follow the load."""

    target_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Load per replica, as a fraction "
        "of its capacity at the baseline tau, that sizing aims for.",
    )
    tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Dead band around the target (no change while |load/target - 1| is within it).",
    )
    scale_up_window_s: float = Field(
        default=20.0,
        ge=0,
        le=3600,
        description="Stabilisation window for scale-up: the smallest recommendation within it is used.",
    )
    scale_down_window_s: float = Field(
        default=300.0,
        ge=0,
        le=86400,
        description="Stabilisation window for scale-down: the largest recommendation within it is used.",
    )
    max_scale_up_replicas: int = Field(
        default=4, ge=1, le=1000, description="Most replicas added per decision."
    )
    max_scale_down_replicas: int = Field(
        default=1, ge=1, le=1000, description="Most replicas removed per decision."
    )
    scale_down_cooldown_s: float = Field(
        default=120.0, ge=0, le=86400, description="No scale-down within this long after any replica change."
    )
    cold_start_s: float = Field(
        default=120.0,
        ge=0,
        le=3600,
        description="Expected time for a new replica to "
        "serve; tau stays wide at least this long after a scale-up.",
    )
    interval_s: float = Field(default=10.0, ge=1, le=600, description="How often the operator re-evaluates.")


class Capacity(_Model):
    """Replica throughput model (from `dmtd bench serve`)."""

    replica_tok_s: float = Field(
        default=2400.0, gt=0, description="Output tokens/s one replica sustains at tau = 1 and full batch."
    )
    tau_speedup: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: list(DEFAULT_TAU_SPEEDUP),
        min_length=1,
        max_length=MAX_TAU,
        description="Relative tokens/s at tau = 1, 2, ...; entry 0 is 1.0.",
    )
    mean_output_tokens: float = Field(
        default=256.0,
        gt=0,
        description="Mean generated tokens per request, used to turn a request rate into a token demand.",
    )


class Cost(_Model):
    """What a GPU costs; drives the $/1M tokens figures."""

    usd_per_gpu_hour: float = Field(default=2.5, ge=0, description="Price of one GPU-hour in USD.")


class SecretKeyRef(_Model):
    """One key of a Secret in the deployment's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$",
                      description="Secret name.")
    key: str = Field(default="api-keys", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="Key in the Secret.")


class GcsFaultTolerance(_Model):
    """The Ray head's GCS state in an external Redis (KubeRay ``gcsFaultToleranceOptions``): when the head dies,
    replicas and the worker-side Serve proxies keep running, and the restarted head resumes from Redis instead of
    a new, empty cluster (docs/operations.md, "What survives what")."""

    enabled: bool = Field(default=True, description="Render gcsFaultToleranceOptions on the RayService.")
    redis_address: str = Field(
        default="", max_length=253, pattern=r"^([^\s:/]+:[0-9]{1,5})?$",
        description="host:port of the Redis the GCS writes to; empty = the variant registry's Redis (its keys "
        "live under the RayCluster's own namespace prefix there).",
    )
    redis_password_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding that Redis's password, if it has one."
    )
    serve_kv_timeout_s: float = Field(
        default=5.0, gt=0, le=600,
        description="RAY_SERVE_KV_TIMEOUT_S: how long a Serve control call (deploy, scale) waits on the GCS's KV "
        "store before it fails; without a bound it blocks for as long as the head is down.",
    )
    worker_reconnect_timeout_s: int = Field(
        default=600, ge=30, le=86400,
        description="RAY_gcs_rpc_server_reconnect_timeout_s of the worker pods: how long they wait for a restarted "
        "head before they give up (must exceed the head's restart time).",
    )


class Serving(_Model):
    """How replicas run: the serving image, where the variant registry lives, authentication and TLS."""

    image: str = Field(default=SERVING_IMAGE, min_length=1, description="Serving image (`make images` builds it).")
    ray_version: str = Field(default="2.60.0", description="Ray version inside the image.")
    registry_url: str = Field(
        default="", description="Redis URL of the variant registry; empty = operator default."
    )
    route_prefix: str = Field(default="/", description="Serve route prefix of the gateway on Serve's proxy (port "
                              "8000); the gateway's own HTTP server, which the gateway Service targets, serves at /.")
    head_cpu: str = Field(default="2", description="CPU request of the Ray head pod (GCS, Serve's controller).")
    head_memory: str = Field(default="8Gi", description="Memory of the Ray head pod.")
    ingress_replicas: int = Field(
        default=2, ge=1, le=16,
        description="Ingress pods: Ray worker pods of their own (group `ingress`) that run the gateway (gRPC, "
        "OpenAI HTTP), one each, and that the gateway Service targets; clients keep being served while the head "
        "is down or restarting.",
    )
    ingress_cpu: str = Field(default="1", description="CPU request of one ingress pod.")
    ingress_memory: str = Field(default="2Gi", description="Memory of one ingress pod.")
    worker_cpu: str = Field(default="4", description="CPU request of one replica's worker pod.")
    worker_memory: str = Field(default="32Gi", description="Memory of one replica's worker pod.")
    api_keys_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API keys (comma- or newline-separated) as env DMTD_API_KEYS; "
        "then every gRPC / HTTP call needs one (authorization: Bearer KEY).",
    )
    tls_secret: str = Field(
        default="", max_length=253, pattern=r"^([a-z0-9]([-.a-z0-9]*[a-z0-9])?)?$",
        description="kubernetes.io/tls Secret (tls.crt, tls.key): the gateway's gRPC and Serve's HTTP serve TLS.",
    )
    gcs_fault_tolerance: GcsFaultTolerance = Field(
        default_factory=GcsFaultTolerance, description="The Ray head's state in Redis, so that it survives the head.",
    )
    grpc_servicer_functions: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GRPC_SERVICERS),
        max_length=8,
        description="Import paths Ray Serve's gRPC proxy registers (serveConfigV2 grpc_options).",
    )


class Engine(EngineSettings):
    """Each replica's engine: sequences at once, context, KV pool, queue, precision and drafts. The serving side's
    own model (`dmtd_contract.serve_config.EngineSettings`) under camelCase names: its defaults and rules are the
    ones `dmtd serve` and the Serve app apply; the operator passes the fields set here to the Serve app."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class MetricsConfig(_Model):
    """Where the operator reads its metric windows."""

    prometheus_url: str = Field(
        default="", description="Prometheus HTTP API base URL; empty = operator default."
    )
    window_s: float = Field(default=60.0, ge=5, le=3600, description="Length of the metrics window.")


class DMTDDeploymentSpec(_Model):
    """A set of DMTD variants served behind one gateway with latency SLOs, scaled by the operator."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.variants.map(v, v.weight).sum() == 100", "variant weights must sum to 100")
        )
    )

    variants: list[Variant] = Field(min_length=1, max_length=16, description="Variants and traffic weights.")
    replicas: ReplicaBounds = Field(default_factory=ReplicaBounds, description="Replica bounds.")
    resources: Resources = Field(default_factory=Resources, description="GPUs per replica and GPU type.")
    slo: Slo = Field(default_factory=Slo, description="Latency SLOs.")
    gpu_utilization: GpuUtilizationBounds = Field(
        default_factory=GpuUtilizationBounds, description="GPU-utilisation guardrail."
    )
    tau: TauPolicy = Field(default_factory=TauPolicy, description="Tau policy bounds.")
    scaling: Scaling = Field(default_factory=Scaling, description="Scaling behaviour.")
    capacity: Capacity = Field(default_factory=Capacity, description="Replica capacity model.")
    cost: Cost = Field(default_factory=Cost, description="GPU price.")
    serving: Serving = Field(default_factory=Serving, description="Serving image and registry.")
    engine: Engine = Field(default_factory=Engine, description="Each replica's engine settings.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics source.")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        total = sum(v.weight for v in self.variants)
        if total != 100:
            raise ValueError(f"variant weights must sum to 100, got {total}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be unique, got {names}")
        if self.tau.max > len(self.capacity.tau_speedup):
            raise ValueError(
                f"capacity.tauSpeedup has {len(self.capacity.tau_speedup)} entries, tau.max is {self.tau.max}"
            )
        return self

    def speedup(self, tau: int) -> float:
        """Relative replica throughput at `tau` (1-based)."""
        return self.capacity.tau_speedup[tau - 1]
