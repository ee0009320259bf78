"""vLLM's extra sampling parameters on the OpenAI endpoints (what ``vllm bench serve``, guidellm, inference-perf and
genai-perf send beside the OpenAI fields).

Each is either served (``ignore_eos``, ``stop_token_ids``, ``min_tokens``: no EOS, stop token or stop string ends
the output before it, as vLLM's; ``top_k`` -1 as off, ``best_of`` equal to ``n``, ``request_id``) or accepted only at
the value that is our behaviour already (``min_p`` 0, ``skip_special_tokens`` true, ``echo`` false, ...); any other
value is refused with a 400 that names the parameter, the value this server serves and why. A key that is neither
OpenAI's nor one of these is refused as before (``Unrecognized request argument supplied``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, Field

from dmtd.serve.requests import MAX_NEW_TOKENS_LIMIT, MAX_STOP, InvalidRequest
from dmtd_contract.records import ReplicaRequest

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]

# parameter -> (the values served: our own behaviour, vLLM's default among them; why no other)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_p": ((0.0, 0), "the sampler has no min-p filter"),
    "use_beam_search": ((False,), "there is no beam search"),
    "length_penalty": ((1.0, 1), "it applies to beam search only"),
    "include_stop_str_in_output": ((False,), "a stop string always ends the text before it"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the text"),
    "priority": ((0,), "requests are served in their arrival order"),
    "truncate_prompt_tokens": ((), "prompts are never truncated"),
    "prompt_logprobs": ((), "prompt positions' log-probabilities are not returned"),
    "allowed_token_ids": ((), "use logit_bias"),
    "bad_words": ((), "use logit_bias"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "logits_processors": ((), "no server-side logits processors are installed"),
    "guided_json": ((), "use response_format with a json_schema"),
    "guided_grammar": ((), "use guided_regex, guided_choice or response_format"),
    "guided_decoding_backend": ((), "the grammar engine is llguidance"),
    "guided_whitespace_pattern": ((), "JSON output uses the grammar's own whitespace"),
    "echo": ((False,), "the response holds the completion only"),
    "add_generation_prompt": ((True,), "chat prompts always end with the assistant's turn"),
    "continue_final_message": ((False,), "chat prompts always end with the assistant's turn"),
    "chat_template": ((), "the model's own chat template is used"),
    "chat_template_kwargs": (({},), "the model's own chat template is used as it is"),
    "documents": ((), "the chat template gets no documents"),
}
# completions are tokenised without special tokens, chat prompts by their template
ADD_SPECIAL_TOKENS = {False: "completions", True: "chat"}


class VllmExtras(BaseModel):
    """vLLM's extra parameters as request fields (mixed into the endpoints' request models)."""

    ignore_eos: bool | None = Field(None, description="vLLM extension: go on past the end-of-sequence token")
    min_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS_LIMIT, description=(
        "vLLM extension: no EOS, stop token or stop string ends the completion before this many tokens"))
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP,
                                                 description="vLLM extension: token ids that end the completion")
    best_of: int | None = Field(None, ge=1, description="vLLM extension: served when equal to n")
    request_id: str | None = Field(None, max_length=128, description="vLLM extension: as user_request_id")
    add_special_tokens: bool | None = None
    min_p: float | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: int | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    guided_json: Any = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionExtras(BaseModel):
    echo: bool | None = None


class ChatExtras(BaseModel):
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None


def _same(value: Any, served: Any) -> bool:
    """Equal and of one kind (JSON's true is not 1)."""
    return isinstance(value, bool) == isinstance(served, bool) and value == served


def check_neutral(body: Any, chat: bool) -> None:
    """Refuse a vLLM parameter set to a value other than our behaviour, naming it and what is served."""
    for name, (served, why) in NEUTRAL.items():
        value = getattr(body, name, None)
        if value is None or any(_same(value, v) for v in served):
            continue
        shown = json.dumps(served[0]) if served else "null"
        raise InvalidRequest(name, f"{json.dumps(value, default=str)} is not supported by this server ({why}); it "
                             f"serves {shown}")
    if body.add_special_tokens is not None and ADD_SPECIAL_TOKENS[body.add_special_tokens] != (
            "chat" if chat else "completions"):
        given = body.add_special_tokens
        raise InvalidRequest("add_special_tokens", f"{json.dumps(given)} is not supported on this endpoint (it serves "
                             f"{json.dumps(not given)}: completions are tokenised without special tokens, chat prompts "
                             "by their template)")


def apply_extras(body: Any, req: ReplicaRequest, n: int) -> None:
    """The served vLLM parameters of ``body`` onto ``req``; the others checked at our behaviour."""
    check_neutral(body, chat=hasattr(body, "messages"))
    if body.best_of is not None and body.best_of != n:
        raise InvalidRequest("best_of", f"must equal n ({n}) on this server (no server-side choice among samples), "
                             f"got {body.best_of}")
    if body.ignore_eos:
        req.ignore_eos = True
    if body.stop_token_ids:
        req.stop_token_ids = list(body.stop_token_ids)
    if body.request_id and not req.request_id:
        req.request_id = body.request_id
    m = body.min_tokens or 0
    if m > req.max_new_tokens:
        raise InvalidRequest("min_tokens", f"must be <= max_tokens ({req.max_new_tokens}), got {m}")
    if m == req.max_new_tokens:  # nothing may end it before max tokens: no EOS, stop token or string (no shaping)
        req.ignore_eos, req.stop, req.stop_token_ids = True, [], []
    else:
        req.min_tokens = m
