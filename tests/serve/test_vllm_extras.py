"""vLLM's extra sampling parameters over the real stack's OpenAI endpoint: the payloads ``vllm bench serve`` and
guidellm send are served as they are; ``ignore_eos``, ``min_tokens`` and ``stop_token_ids`` do what vLLM's do; the
ones this server does not serve are refused with a 400 naming them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from dmtd.client import DMTDClient
from tests.serve.conftest import VARIANT
from tests.serve.test_stack import CHAT


def post(stack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body) of a POST; a stream's events as a list of JSON objects."""
    req = urllib.request.Request(stack.http_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if body.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(raw)


def test_the_payloads_vllm_bench_serve_and_guidellm_send_are_served(stack):
    # vllm bench serve --backend openai (completions) with --ignore-eos, its sampling fields at their defaults
    status, events = post(stack, "/v1/completions", {
        "model": VARIANT, "prompt": "The history of the printing press", "temperature": 0.0, "repetition_penalty": 1.0,
        "max_tokens": 6, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "best_of": 1})
    assert status == 200
    assert events[-1]["usage"]["completion_tokens"] == 6 and "".join(e["choices"][0]["text"] for e in events[:-1])
    # guidellm's chat payload with a fixed output length
    status, out = post(stack, "/v1/chat/completions", {
        "model": VARIANT, "messages": CHAT, "max_tokens": 5, "max_completion_tokens": 5, "stop": None,
        "ignore_eos": True, "skip_special_tokens": True, "spaces_between_special_tokens": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_and_min_tokens_go_on_past_the_end_of_the_answer(stack):
    short = {"model": VARIANT, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40,
             "temperature": 0.0}
    status, out = post(stack, "/v1/chat/completions", short)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"  # the answer ends before 40 tokens
    n = out["usage"]["completion_tokens"]
    assert n < 40
    for extra in ({"ignore_eos": True}, {"min_tokens": 40}, {"min_tokens": 40, "stop": ["!", "."]}):
        status, longer = post(stack, "/v1/chat/completions", {**short, **extra})
        assert status == 200, longer
        assert longer["usage"]["completion_tokens"] == 40 and longer["choices"][0]["finish_reason"] == "length"
        assert longer["choices"][0]["message"]["content"].startswith(out["choices"][0]["message"]["content"])
    # min_tokens below max tokens: no EOS, stop token or stop string before it; then the answer may end
    m = min(n + 5, 39)
    status, some = post(stack, "/v1/chat/completions", {**short, "min_tokens": m, "stop": ["!", "."]})
    assert status == 200 and m <= some["usage"]["completion_tokens"] <= 40, some


def test_stop_token_ids_end_the_completion_at_that_token(stack):
    prompt = "Here is a list of five fruits:"
    with DMTDClient(stack.grpc_target) as c:
        ids = [t for b in c.generate(prompt=prompt, max_new_tokens=12, ignore_eos=True) for t in b.token_ids]
    k = 4
    stop_id = ids[k]
    first = ids.index(stop_id)  # the first time that token comes
    status, out = post(stack, "/v1/completions", {"model": VARIANT, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_id]})
    assert status == 200
    assert out["usage"]["completion_tokens"] == first + 1 and out["choices"][0]["finish_reason"] == "stop"


def test_parameters_this_server_does_not_serve_are_refused_naming_them(stack):
    base = {"model": VARIANT, "prompt": "Hello", "max_tokens": 8}
    cases = {"min_p": 0.1, "use_beam_search": True, "echo": True, "truncate_prompt_tokens": 4, "best_of": 3,
             "include_stop_str_in_output": True, "min_tokens": 9, "guided_json": {"type": "object"}}
    for name, value in cases.items():
        status, out = post(stack, "/v1/completions", {**base, name: value})
        assert status == 400, (name, out)
        assert out["error"]["param"] == name and name in out["error"]["message"], out
        assert "not supported" in out["error"]["message"] or "must" in out["error"]["message"]
    status, out = post(stack, "/v1/chat/completions", {"model": VARIANT, "messages": CHAT, "max_tokens": 4,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 400 and out["error"]["param"] == "chat_template_kwargs"
    status, out = post(stack, "/v1/completions", {**base, "no_such_parameter": 1})
    assert status == 400 and "Unrecognized request argument supplied: no_such_parameter" in out["error"]["message"]
