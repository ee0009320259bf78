"""A shape folder served as ``dmtd serve --model DIR --load-format dummy`` serves it: config and tokenizer only,
random weights, and a tokenizer without a chat template (a base model's). The replica warms up on text and comes
up; completions are served; chat requests get a 400 that says why."""

from __future__ import annotations

import pytest

from tests.serve.conftest import free_port
from tests.serve.test_vllm_extras import post
from tests.variants.test_shapes import tiny_shape

NAME = "shape-base"


@pytest.fixture(scope="module")
def shape_stack(stack, tmp_path_factory):
    """A second Serve app beside the main stack's: one replica of a tiny shape folder, its own gateway."""
    from ray import serve

    from dmtd.serve.app import build_app
    from dmtd.variants.shapes import export_shape

    folder = export_shape(tiny_shape("qwen3"), tmp_path_factory.mktemp("shape") / "base", chat_template=False)
    http_port = free_port()
    app = build_app({
        "variants": [{"name": NAME, "variant": "none", "model": str(folder), "load_format": "dummy",
                      "dtype": "float32"}],
        "grpc_port": free_port(), "http_port": http_port, "max_num_seqs": 2, "max_queued": 2, "max_model_len": 256,
        "replica_num_cpus": 0, "omp_wait_policy": "PASSIVE",
    })
    serve.run(app, name="dmtd-shape", route_prefix="/shape")
    yield type(stack)(stack.grpc_target, f"http://127.0.0.1:{http_port}", "dmtd-shape", stack.registry_url)
    serve.delete("dmtd-shape")


def test_a_model_without_chat_template_warms_up_and_reports_ready(shape_stack):
    """The gateway's start-up check (what ``dmtd serve`` waits on before it says it serves) sends a prompt through its
    own path and a completion through its OpenAI route: such a model serves both."""
    from ray import serve

    state = serve.get_deployment_handle("Gateway", app_name="dmtd-shape").wait_ready.remote(120).result()
    assert state["ready"] and {NAME, "http"} <= state["warm_s"].keys(), state


def test_a_model_without_chat_template_serves_completions_and_refuses_chat_with_a_400(shape_stack):
    status, out = post(shape_stack, "/v1/completions", {"model": NAME, "prompt": "Once upon a time", "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 6 and out["choices"][0]["text"]
    status, again = post(shape_stack, "/v1/completions", {"model": NAME, "prompt": "Once upon a time",
                                                          "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert again["choices"][0]["text"] == out["choices"][0]["text"]  # seeded weights, greedy: the same text
    status, err = post(shape_stack, "/v1/chat/completions", {"model": NAME, "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "Hello!"}]})
    assert status == 400, err
    assert err["error"]["param"] == "messages" and "no chat template" in err["error"]["message"]
    assert "completions" in err["error"]["message"]
    # and the refusal lost nothing: the replica serves the next completion
    status, after = post(shape_stack, "/v1/completions", {"model": NAME, "prompt": "Once upon a time",
                                                          "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert status == 200 and after["choices"][0]["text"] == out["choices"][0]["text"]
