from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CycleProfile(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CYCLE_PROFILE_UNSPECIFIED: _ClassVar[CycleProfile]
    CYCLE_PROFILE_QUALITY: _ClassVar[CycleProfile]
    CYCLE_PROFILE_BALANCED: _ClassVar[CycleProfile]
    CYCLE_PROFILE_SPEED: _ClassVar[CycleProfile]
    CYCLE_PROFILE_EXACT: _ClassVar[CycleProfile]
    CYCLE_PROFILE_ADAPTIVE: _ClassVar[CycleProfile]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
CYCLE_PROFILE_UNSPECIFIED: CycleProfile
CYCLE_PROFILE_QUALITY: CycleProfile
CYCLE_PROFILE_BALANCED: CycleProfile
CYCLE_PROFILE_SPEED: CycleProfile
CYCLE_PROFILE_EXACT: CycleProfile
CYCLE_PROFILE_ADAPTIVE: CycleProfile
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class CyclePreferences(_message.Message):
    __slots__ = ("tau_min", "tau_max", "min_confidence", "profile")
    TAU_MIN_FIELD_NUMBER: _ClassVar[int]
    TAU_MAX_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    tau_min: int
    tau_max: int
    min_confidence: float
    profile: CycleProfile
    def __init__(self, tau_min: _Optional[int] = ..., tau_max: _Optional[int] = ..., min_confidence: _Optional[float] = ..., profile: _Optional[_Union[CycleProfile, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "variant", "sampling", "max_new_tokens", "stop", "stop_token_ids", "cycle", "min_block_tokens", "flush_interval_ms", "ignore_eos", "logprobs", "json_schema")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: ChatMessages
    variant: str
    sampling: SamplingOptions
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cycle: CyclePreferences
    min_block_tokens: int
    flush_interval_ms: int
    ignore_eos: bool
    logprobs: int
    json_schema: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., variant: _Optional[str] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cycle: _Optional[_Union[CyclePreferences, _Mapping]] = ..., min_block_tokens: _Optional[int] = ..., flush_interval_ms: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ...) -> None: ...

class ConfidenceSummary(_message.Message):
    __slots__ = ("min", "mean", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: float
    mean: float
    max: float
    def __init__(self, min: _Optional[float] = ..., mean: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_ms", "block_ms", "queue_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    block_ms: float
    queue_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., block_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "blocks", "heads", "cycles_cut", "drafted_tokens", "accepted_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    CYCLES_CUT_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    blocks: int
    heads: int
    cycles_cut: int
    drafted_tokens: int
    accepted_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., heads: _Optional[int] = ..., cycles_cut: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenBlock(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "block_index", "k", "tau", "min_confidence", "confidence", "timings", "finish_reason", "usage", "variant", "replica", "num_drafted", "num_accepted", "verifier", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    block_index: int
    k: int
    tau: int
    min_confidence: float
    confidence: ConfidenceSummary
    timings: Timings
    finish_reason: FinishReason
    usage: Usage
    variant: str
    replica: str
    num_drafted: int
    num_accepted: int
    verifier: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., block_index: _Optional[int] = ..., k: _Optional[int] = ..., tau: _Optional[int] = ..., min_confidence: _Optional[float] = ..., confidence: _Optional[_Union[ConfidenceSummary, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., variant: _Optional[str] = ..., replica: _Optional[str] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., verifier: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class VariantInfo(_message.Message):
    __slots__ = ("name", "base_model", "status", "traffic_weight", "tau_min", "tau_max", "default_tau", "min_confidence", "num_encoding_layers", "num_thinking_layers", "num_decoding_layers", "phase_anchor", "head_input", "revision", "is_default", "default_profile", "verifier")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TAU_MIN_FIELD_NUMBER: _ClassVar[int]
    TAU_MAX_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TAU_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_THINKING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PHASE_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    HEAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROFILE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    status: str
    traffic_weight: float
    tau_min: int
    tau_max: int
    default_tau: int
    min_confidence: float
    num_encoding_layers: int
    num_thinking_layers: int
    num_decoding_layers: int
    phase_anchor: str
    head_input: str
    revision: int
    is_default: bool
    default_profile: str
    verifier: str
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., status: _Optional[str] = ..., traffic_weight: _Optional[float] = ..., tau_min: _Optional[int] = ..., tau_max: _Optional[int] = ..., default_tau: _Optional[int] = ..., min_confidence: _Optional[float] = ..., num_encoding_layers: _Optional[int] = ..., num_thinking_layers: _Optional[int] = ..., num_decoding_layers: _Optional[int] = ..., phase_anchor: _Optional[str] = ..., head_input: _Optional[str] = ..., revision: _Optional[int] = ..., is_default: _Optional[bool] = ..., default_profile: _Optional[str] = ..., verifier: _Optional[str] = ...) -> None: ...

class ListVariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVariantsResponse(_message.Message):
    __slots__ = ("variants", "registry_revision")
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_REVISION_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[VariantInfo]
    registry_revision: int
    def __init__(self, variants: _Optional[_Iterable[_Union[VariantInfo, _Mapping]]] = ..., registry_revision: _Optional[int] = ...) -> None: ...

class GetVariantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
