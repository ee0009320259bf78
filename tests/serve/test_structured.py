"""The gateway's side of the new OpenAI fields, without a stack: request conversion, grammars, tool calls."""

from __future__ import annotations

import json

import pytest

from dmtd.serve.openai_models import expand, parse_body
from dmtd.serve.requests import InvalidRequest, Limits, validate
from dmtd.serve.structured import tool_calls

CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def parse(chat: bool = True, **body):
    body.setdefault("messages" if chat else "prompt", CHAT if chat else "hi")
    return parse_body(json.dumps(body).encode(), chat, 0.0, Limits())


def test_shaping_fields_reach_the_replica_request():
    req, _ = parse(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"7": -100},
                   logprobs=True, top_logprobs=3, seed=5)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1.0, 1.2)
    assert req.logit_bias == [(7, -100.0)] and req.logprobs == 3 and req.grammar == ""
    assert parse(logprobs=False)[0].logprobs == -1 and parse(logprobs=True)[0].logprobs == 0
    assert parse(chat=False, logprobs=2)[0].logprobs == 2


def test_n_copies_are_independent_requests():
    req, body = parse(n=3, seed=10)
    copies = expand(req, body.n)
    assert [c.request_id for c in copies] == [f"{req.request_id}-{i}" for i in range(3)]
    assert [c.seed for c in copies] == [10, 11, 12]
    assert [c.prefill_with for c in copies] == ["", f"{req.request_id}-0", f"{req.request_id}-0"]
    copies[0].stop.append("x")
    assert copies[1].stop == []
    assert expand(req, 1) == [req]


def test_response_formats_and_guides_become_checked_grammars():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req, _ = parse(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                           "strict": True}})
    assert "json_schema" in req.grammar and '"a"' in req.grammar
    assert "json_schema" in parse(response_format={"type": "json_object"})[0].grammar
    assert parse(response_format={"type": "text"})[0].grammar == ""
    assert parse(guided_choice=["a.b", "c"])[0].grammar and parse(guided_regex="[0-9]+")[0].grammar
    with pytest.raises(InvalidRequest) as e:
        parse(guided_regex="x", guided_choice=["y"])
    assert e.value.field == "guided_choice"


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"n": 9}, "n"),
])
def test_bad_fields_name_the_openai_field(body, field):
    with pytest.raises(InvalidRequest) as e:
        parse(**body)
    assert e.value.field == field and str(e.value).startswith(field)


def test_tools_are_described_and_required_calls_constrained():
    req, body = parse(tools=[TOOL], tool_choice="required")
    assert req.messages[0]["role"] == "system" and "get_weather" in req.messages[0]["content"]
    assert "get_weather" in req.grammar
    assert parse(tools=[TOOL], tool_choice="none")[0].messages == CHAT
    calls = tool_calls(body, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert calls is not None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_calls(body, "It is sunny.") is None
    assert tool_calls(body, '{"name": "other", "arguments": {}}') is None
    msgs = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    req, _ = parse(messages=msgs, tools=[TOOL])
    assert req.messages[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'}
    assert req.messages[3] == {"role": "user", "content": "Result of tool call c1: rain"}


@pytest.mark.parametrize("chat,body,limits,message", [
    (True, {"tau_min": 3, "tau_max": 2}, {}, "tau_min: must be <= tau_max (2), got 3"),
    (False, {"tau_min": 3, "tau_max": 2}, {}, "tau_min: must be <= tau_max (2), got 3"),
    (True, {"messages": [{"role": "user", "content": "x" * 40}]}, {"max_prompt_chars": 32},
     "messages[0].content: all contents together at most 32 characters"),
    (True, {"messages": CHAT * 3}, {"max_messages": 2}, "messages: at most 2 messages, got 3"),
    (False, {"prompt": [1] * 40}, {"max_prompt_chars": 32}, "prompt: at most 32 token ids, got 40"),
])
def test_validation_raises_in_the_openai_apis_own_names(chat, body, limits, message):
    """What the shared validation refuses, an OpenAI request hears in its API's names, as raised (nothing renamed);
    the gRPC API's names for the same rule are its own."""
    with pytest.raises(InvalidRequest) as e:
        parse_body(json.dumps({"model": "m", **({"messages": CHAT} if chat else {"prompt": "hi"}), **body}).encode(),
                   chat, 0.0, Limits(**limits))
    assert str(e.value) == message and e.value.__cause__ is None
    req, _ = parse(chat=chat)
    req.tau_min, req.tau_max, req.field_names = 3, 2, "grpc"
    with pytest.raises(InvalidRequest) as g:
        validate(req)
    assert str(g.value) == "cycle.tau_min: must be <= cycle.tau_max (2), got 3" and g.value.field == "cycle.tau_min"


def test_a_request_that_names_no_length_gets_the_one_default():
    from dmtd.client import build_request
    from dmtd.serve.requests import from_proto
    from dmtd_contract.records import MAX_NEW_TOKENS_DEFAULT, ReplicaRequest

    assert parse(chat=True)[0].max_new_tokens == parse(chat=False)[0].max_new_tokens == MAX_NEW_TOKENS_DEFAULT
    assert from_proto(build_request(prompt="hi", max_new_tokens=0), 0.0).max_new_tokens == MAX_NEW_TOKENS_DEFAULT
    assert build_request(prompt="hi").max_new_tokens == ReplicaRequest("r").max_new_tokens == MAX_NEW_TOKENS_DEFAULT
