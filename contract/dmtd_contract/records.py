"""The records that cross the Ray hop between the gateway and a replica: plain dataclasses, pickled by Ray.

* ``ReplicaRequest``: what a replica needs to run one request (the gateway validates it first; the replica
  checks every field's type again, since it may be called past the gateway).
* ``Block``: what a replica streams back, one per completed DMTD cycle; the last one carries
  ``finish_reason`` and ``usage``.

Every field has a default, so a field added later (the proto grows) is an addition here, not a change of
every constructor call. No dicts cross the hop for requests or blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# one token's log-probability: (token id, its bytes, log p, the most likely tokens as (id, bytes, log p))
TokenLogprob = tuple[int, bytes, float, list[tuple[int, bytes, float]]]


# the length of an answer whose request names none: one default for the gRPC and OpenAI APIs, the client and the replica
MAX_NEW_TOKENS_DEFAULT = 128


@dataclass(slots=True)
class ReplicaRequest:
    """What a replica needs to run one request."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int = MAX_NEW_TOKENS_DEFAULT
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output before this many tokens
    tau_min: int = 0
    tau_max: int = 0
    min_confidence: float | None = None
    profile: str = ""  # "" = the variant's default profile; else adaptive / quality / balanced / speed / exact
    arrival_s: float = 0.0
    traceparent: str = ""  # W3C trace context of the gateway span: the replica span becomes its child
    sent_s: float = 0.0  # wall time the gateway handed it to Ray (the request's Ray hop, in the replica span)
    # where the replica pushes the request's blocks (``host:port`` of the gateway's block sink, and the
    # request's secret there); empty: the blocks come back as the Serve call's streamed items
    push_to: str = ""
    push_token: str = ""
    # the request's shaping of the logits its tokens are drawn from (the verifier's, for exact requests)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias)
    grammar: str = ""  # the output must match it (llguidance's JSON grammar form); "" = free text
    logprobs: int = -1  # >= 0: each token's log-probability and this many most likely alternatives; -1: none
    prefill_with: str = ""  # a sibling request (same prompt, the OpenAI API's n) whose prefill this one may share
    # the API the caller speaks, whose names a refusal of the request uses wherever it is raised (the gateway or
    # the replica): "grpc" (``sampling.temperature``, ``chat.messages[0].content``), "openai-chat" /
    # "openai-completions" (``temperature``, ``messages[0].content``, ``max_tokens``)
    field_names: str = "grpc"
    # the variant that runs it, of those its replica serves over one trunk (the gateway's route name); "": the
    # replica's own
    variant: str = ""


@dataclass(slots=True)
class Usage:
    """Token accounting of a finished request (the last block's)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    blocks: int = 0
    heads: int = 0
    cycles_cut: int = 0
    drafted_tokens: int = 0  # exact profile
    accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class Block:
    """One block of a stream: the tokens of one DMTD cycle (k of them at τ = ``tau``) and its text delta."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # UTF-8-safe delta since the previous block
    block_index: int = 0
    k: int = 0
    tau: int = 1
    min_confidence: float = 0.0  # gate in force
    confidence: tuple[float, float, float] = (0.0, 0.0, 0.0)  # min, mean, max top-1 probability
    block_ms: float = 0.0
    queue_ms: float = 0.0  # first block only: admission wait at the replica
    replica: str = ""
    finish_reason: str | None = None  # last block only: stop / length / abort / error
    error: str | None = None
    usage: Usage | None = None  # last block only
    num_drafted: int = 0  # exact profile: drafts checked by the head that closed this block
    num_accepted: int = 0
    verifier: str = ""  # exact profile, last block: "base" or "variant"
    # stage timings (the gateway sums them into its span): wall time of the engine steps this request ran in
    # since its previous block; from the end of the step that completed the block to the replica handing it
    # to Serve; and when that was (wall clock: the gateway's receipt minus it is the block's Ray hop)
    step_ms: float = 0.0
    dispatch_ms: float = 0.0
    sent_s: float = 0.0
    # CPU time of the engine's thread in those steps: ``step_ms`` minus it is time the thread was runnable
    # but preempted, or waiting (for the GIL, for the event loop to hand it the next step)
    step_cpu_ms: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked for them
