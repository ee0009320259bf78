"""The OpenAI API's logprobs, n, penalties, structured outputs and tools over the real stack, driven by the
official ``openai`` client; exactness against the base model (its whole-sequence forward, or the ``--variant none``
engine at τ = 1 with the same shaping)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from tests.serve.conftest import VARIANT
from tests.serve.test_stack import CHAT

EXACT = {"dmtd_profile": "exact", "tau_min": 3, "tau_max": 3, "min_confidence": 0.0}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 16}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def base(smollm2):
    """The ``--variant none`` engine at τ = 1: the base model."""
    return LLMEngine(smollm2.model, smollm2.tokenizer, DMTDConfig.plain(30, 8, 4),
                     EngineConfig(max_num_seqs=2, max_model_len=1024))


def base_logprobs(smollm2, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    logits = smollm2.model.forward_masked(x, torch.ones_like(x), DMTDConfig.plain(30, 8, 1))[0]
    return torch.log_softmax(logits.float(), -1)


def test_chat_logprobs_of_an_exact_request_are_the_base_models(client, base, smollm2):
    r = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=4, extra_body=EXACT)
    content = r.choices[0].logprobs.content
    assert r.usage.completion_tokens_details.model_extra["drafted_tokens"] > 0
    ref = base.generate([CHAT], SamplingParams(max_new_tokens=16, tau=1))[0]
    emitted = [t for t in ref.token_ids if t not in base.eos_ids]
    assert "".join(c.token for c in content) == r.choices[0].message.content == ref.text
    assert len(content) == len(emitted)
    lp = base_logprobs(smollm2, ref.prompt_token_ids + ref.token_ids)
    start = len(ref.prompt_token_ids) - 1
    for j, (c, tok) in enumerate(zip(content, emitted)):
        assert abs(c.logprob - float(lp[start + j, tok])) < 1e-4, (j, c.logprob, float(lp[start + j, tok]))
        assert bytes(c.bytes) == smollm2.tokenizer.decode([tok]).encode() or "\ufffd" in c.token
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
        top = lp[start + j].topk(4)
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(c.top_logprobs, top.values))
    stream = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=4, extra_body=EXACT, stream=True)
    streamed = [c for ch in stream for c in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completions_logprobs_shape(client):
    r = client.completions.create(model=VARIANT, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 3 for d in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(max(d.values()) >= v - 1e-6 for d, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_penalties_and_logit_bias_exact_equal_the_shaped_base(client, base):
    shaping = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"330": 5.0, "28": -100.0})
    r = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=24, temperature=0,
                                       extra_body={**EXACT, "repetition_penalty": 1.3}, **shaping)
    ref = base.generate([CHAT], SamplingParams(max_new_tokens=24, tau=1, presence_penalty=1.2,
                                               frequency_penalty=0.6, repetition_penalty=1.3,
                                               logit_bias={330: 5.0, 28: -100.0}))[0]
    plain = base.generate([CHAT], SamplingParams(max_new_tokens=24, tau=1))[0]
    assert r.choices[0].message.content == ref.text != plain.text
    assert r.usage.completion_tokens_details.model_extra["drafted_tokens"] > 0


def test_n_independent_samples_streamed_and_not(client):
    r = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) >= 2  # independent samples, not one copied
    again = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=12, temperature=1.0, seed=7,
                                           n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    assert r.usage.completion_tokens <= 36 and r.usage.prompt_tokens < r.usage.completion_tokens + 100
    stream = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=12, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]  # greedy: both the same
    single = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=12, temperature=0)
    assert texts[0] == single.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 2 * single.usage.completion_tokens


def test_json_schema_strict_exact_is_valid_and_the_constrained_base(client, base):
    import llguidance

    chat = [{"role": "user", "content": "Give me a person as JSON with name, age and city."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=VARIANT, messages=chat, max_tokens=80, temperature=0,
                                       response_format=fmt, extra_body=EXACT)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    ref = base.generate([chat], SamplingParams(max_new_tokens=80, tau=1, grammar=grammar))[0]
    assert text == ref.text and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=VARIANT, messages=chat, max_tokens=80, temperature=0.8, seed=3,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in stream)), PERSON)
    obj = client.chat.completions.create(model=VARIANT, messages=chat, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_guided_choice_and_regex(client):
    r = client.chat.completions.create(model=VARIANT, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=8, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=VARIANT, prompt="A date: ", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    import re

    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text)


def test_tools_required_named_and_streamed(client):
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=VARIANT, messages=chat, max_tokens=60, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice=choice, extra_body=EXACT)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        schema = WEATHER if call.function.name == "get_weather" else TIME
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])
    stream = client.chat.completions.create(model=VARIANT, messages=chat, max_tokens=60, temperature=0,
                                            tools=[WEATHER], tool_choice="required", stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = chat + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=VARIANT, messages=follow, max_tokens=20, temperature=0,
                                       tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_models_list_every_variant_with_its_profile(client):
    models = client.models.list().data
    assert [m.id for m in models] == [VARIANT]
    extra = models[0].model_extra
    assert extra["dmtd"]["default_profile"] == "dmtd" and extra["dmtd"]["profiles"][-1] == "exact"


def test_grpc_token_blocks_carry_logprobs_and_take_a_json_schema(stack, client):
    from dmtd.client import DMTDClient

    with DMTDClient(stack.grpc_target) as c:
        blocks = list(c.generate(messages=CHAT, max_new_tokens=12, logprobs=2, profile="exact", tau_min=3, tau_max=3,
                                 min_confidence=0.0, presence_penalty=0.5))
        plain = list(c.generate(messages=CHAT, max_new_tokens=12))
        schema = list(c.generate(messages=CHAT, max_new_tokens=60, json_schema=json.dumps(PERSON)))
    entries = [e for b in blocks for e in b.logprobs]
    tokens = [t for b in blocks for t in b.token_ids]
    assert [e.token_id for e in entries] == tokens[: len(entries)] and len(entries) >= len(tokens) - 1
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.logprob - 1e-6 for e in entries)
    assert not any(b.logprobs for b in plain)
    r = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2, presence_penalty=0.5, extra_body=EXACT)
    content = r.choices[0].logprobs.content
    assert len(content) == len(entries) and all(abs(c.logprob - e.logprob) < 1e-5 for c, e in zip(content, entries))
    jsonschema.validate(json.loads("".join(b.text for b in schema)), PERSON)


EXTENSIONS = {"dmtd", "drafted_tokens", "accepted_tokens"}  # ours, documented as extensions


def _models(annotation) -> list[type]:
    """The pydantic models an annotation names (through Optional, List, Union, Annotated)."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def conforms(value, model, path: str = "") -> None:
    """``value`` (JSON) has only fields ``model`` (the openai library's type, generated from OpenAI's OpenAPI
    document) knows, every required one, recursively; extension fields aside."""
    assert isinstance(value, dict), (path, value)
    fields = model.model_fields
    unknown = set(value) - set(fields) - EXTENSIONS
    assert not unknown, f"{path}: {sorted(unknown)} not in {model.__name__}"
    missing = [k for k, f in fields.items() if f.is_required() and k not in value]
    assert not missing, f"{path}: {model.__name__} requires {missing}"
    for key, v in value.items():
        if key not in fields or v is None:
            continue
        candidates = _models(fields[key].annotation)
        for item in (v if isinstance(v, list) else [v]):
            if not candidates or not isinstance(item, dict):
                continue
            errors = []
            for cand in candidates:
                try:
                    conforms(item, cand, f"{path}.{key}")
                    break
                except AssertionError as e:
                    errors.append(str(e))
            else:
                raise AssertionError("; ".join(errors))


def test_response_shapes_field_by_field_against_the_openai_types(stack):
    import requests
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    url = stack.http_url + "/v1"
    chat = requests.post(url + "/chat/completions", json={
        "model": VARIANT, "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "n": 2, **EXACT}, timeout=300).json()
    conforms(chat, ChatCompletion)
    assert chat["usage"]["completion_tokens_details"]["drafted_tokens"] > 0
    tools = requests.post(url + "/chat/completions", json={
        "model": VARIANT, "messages": CHAT, "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
        "tool_choice": "required"}, timeout=300).json()
    conforms(tools, ChatCompletion)
    assert tools["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    comp = requests.post(url + "/completions", json={"model": VARIANT, "prompt": "The sky is", "max_tokens": 4,
                                                      "logprobs": 2}, timeout=300).json()
    conforms(comp, Completion)
    lines = requests.post(url + "/chat/completions", json={
        "model": VARIANT, "messages": CHAT, "max_tokens": 8, "logprobs": True, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=300).text.split("\n\n")
    chunks = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
    assert len(chunks) >= 3 and lines[-2] == "data: [DONE]"
    for ch in chunks:
        conforms(ch, ChatCompletionChunk)
    for m in requests.get(url + "/models", timeout=30).json()["data"]:
        conforms(m, Model)


def test_closing_an_n_stream_frees_every_choices_slot(stack, client):
    from tests.serve.test_stack import wait_idle

    for n in (1, 3):
        stream = client.chat.completions.create(model=VARIANT, messages=CHAT, max_tokens=400, n=n, stream=True,
                                                temperature=1.0, seed=5)
        seen = {c.index for ch, _ in zip(stream, range(3 * n)) for c in ch.choices}
        assert seen <= set(range(n)) and seen
        stream.close()
        stats = wait_idle(stack, 30)
        assert stats["active"] == 0 and stats["free_kv_rows"] == 8


def test_a_shared_system_prompt_is_cached_and_the_text_stays_the_base_models(client, base):
    """The second request with the same long system message reuses its whole chunks (usage reports them as
    OpenAI does, prompt_tokens_details.cached_tokens); both texts are the base model's alone."""
    system = " ".join(f"Rule {i}: answer kindly, briefly and accurately about topic {i}." for i in range(30))
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("Name a fruit.", "Name a colour.")]
    rs = [client.chat.completions.create(model=VARIANT, messages=m, max_tokens=12, temperature=0, extra_body=EXACT)
          for m in msgs]
    assert rs[0].usage.prompt_tokens > 300
    cached = rs[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached % 128 == 0 and cached < rs[1].usage.prompt_tokens
    for m, r in zip(msgs, rs):
        ref = base.generate([m], SamplingParams(max_new_tokens=12, tau=1))[0]
        assert r.choices[0].message.content == ref.text
