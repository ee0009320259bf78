"""Prefix-aware routing over two real replicas (Serve's request-router API): requests that share a system prompt
go to the replica holding it, whose prefix cache then serves it; distinct prompts spread over both; a replica
that dies leaves the index and requests go on to the survivor."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections import Counter

import pytest

from dmtd.bench.routing_bench import route_decisions
from dmtd.client import DMTDClient
from dmtd.serve.prefix_router import InFlight, PrefixIndex, gateway_sink, prompt_text, text_keys
from tests.serve.conftest import VARIANT, free_port

SYSTEMS = [" ".join(f"Policy {p}.{i}: reply politely and concisely about subject {i * 3 + p}." for i in range(40))
           for p in range(4)]
QUESTIONS = ["Name a fruit.", "Name a colour.", "Name a city.", "Name an animal."]


@pytest.fixture(scope="module")
def two_replicas(stack):
    """A second app on the tests' Ray cluster: two replicas of the base model behind their own gateway."""
    from ray import serve

    from dmtd.serve.app import build_app

    port = free_port()
    app = build_app({
        "variants": [{"name": VARIANT, "variant": "none", "decoding_layers": 8, "tau_max": 4, "dtype": "bfloat16",
                      "replicas": 2}],
        "grpc_port": port, "max_num_seqs": 4, "max_model_len": 1024, "registry_url": stack.registry_url,
        "replica_num_cpus": 0.5, "omp_wait_policy": "PASSIVE", "routing": "prefix",
        "metrics_port": free_port(), "replica_metrics_port": free_port(),
    })
    serve.run(app, name="dmtd-two", route_prefix="/two")
    yield f"127.0.0.1:{port}"
    serve.delete("dmtd-two")


def ask(target: str, system: str, question: str) -> tuple[str, int, int]:
    """One greedy chat request: (replica, prompt tokens, cached prompt tokens)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    with DMTDClient(target) as c:
        blocks = list(c.generate(messages=msgs, max_new_tokens=4, profile="exact", timeout_s=300))
    last = blocks[-1]
    return last.replica, last.usage.prompt_tokens, last.usage.cached_tokens


def test_requests_follow_their_prefix_and_prefixes_spread(two_replicas):
    first = {s: ask(two_replicas, s, QUESTIONS[0]) for s in SYSTEMS}  # one at a time: each a new prefix
    assert len({r for r, _, _ in first.values()}) == 2  # distinct prompts spread over both replicas
    jobs = [(s, q) for q in QUESTIONS[1:] for s in SYSTEMS]
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: (job[0], *ask(two_replicas, *job)), jobs))
    same = sum(r == first[s][0] for s, r, _, _ in got)
    assert same >= len(got) - 2  # at c = 4 the load fallback may move one or two
    prompt, cached = sum(p for _, _, p, _ in got), sum(c for _, _, _, c in got)
    assert cached / prompt >= 0.6  # whole chunks of 128 of ~480-token prompts: ~0.8 when every one hits
    share = Counter(r for _, r, _, _ in got)
    assert max(share.values()) <= 0.75 * len(got)


def test_the_gateway_counts_decisions_by_reason(two_replicas):
    """The decisions above reach the gateway's metrics: the router reports each to the Serve replica it runs in, the
    gateway (``on_route_decision``; the router class Serve hands the gateway can be a copy of its module, so nothing
    goes through that module's globals). Outside a replica a router has no gateway to report to."""
    assert gateway_sink() is None
    from ray import serve

    url = serve.get_deployment_handle("Gateway", app_name="dmtd-two").info.remote().result()["metrics_url"]
    got = route_decisions(url)
    assert got.get("new_prefix", 0) >= len(SYSTEMS) and got.get("prefix", 0) >= 6, got


def test_a_burst_of_new_prefixes_spreads_over_both_replicas(two_replicas):
    """Eight new system prompts at once: the router counts what it has just sent each replica (Serve's queue
    lengths lag a burst), so they split over both replicas instead of all going to one."""
    systems = [s.replace("Policy", f"Burst rule {b}") for b, s in enumerate(SYSTEMS * 2)]
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: ask(two_replicas, s, QUESTIONS[0])[0], systems))
    share = Counter(got)
    assert len(share) == 2 and min(share.values()) >= 3, share


def test_a_dead_replica_leaves_the_index_and_requests_go_on(two_replicas):
    replica, _, _ = ask(two_replicas, SYSTEMS[0], QUESTIONS[0])  # its prefix's replica: "replica-<host>-<pid>"
    os.kill(int(replica.rsplit("-", 1)[1]), signal.SIGKILL)
    deadline, served = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(served) < 4:
        try:
            served.append(ask(two_replicas, SYSTEMS[0], QUESTIONS[len(served)])[0])
        except Exception:
            time.sleep(0.5)
    assert len(served) == 4 and replica not in served  # the survivor (or the dead one's successor) serves


def test_the_index_keeps_prefix_holders_and_forgets_replicas():
    a = text_keys("x" * 600, 256)
    b = text_keys("x" * 512 + "y" * 300, 256)
    assert len(a) == 2 and a[:2] == b[:2] and len(b) == 3
    idx = PrefixIndex(max_keys=4)
    idx.insert(a, "r1")
    assert idx.longest(b, {"r1", "r2"}) == (2, {"r1"}) and idx.longest(b, {"r2"}) == (0, set())
    idx.insert(b, "r2")
    assert idx.longest(b, {"r1", "r2"}) == (3, {"r2"}) and idx.num_prefixes("r2") == 1
    idx.drop("r2")
    assert idx.longest(b, {"r1", "r2"}) == (2, {"r1"})
    idx.insert(text_keys("z" * 1024, 256), "r1")  # 4 more keys: the least recently used go
    assert len(idx.keys) == 4 and idx.longest(a, {"r1"}) == (0, set())


def test_in_flight_counts_routed_requests_until_they_complete():
    now = [0.0]
    inflight = InFlight(ttl_s=60.0, clock=lambda: now[0])
    for rid, replica in [("a", "r1"), ("b", "r1"), ("c", "r2")]:
        inflight.assign(rid, replica)
    assert inflight.counts() == {"r1": 2, "r2": 1}
    inflight.assign("b", "r2")  # routed again: counted where it went last
    inflight.complete("a")
    inflight.complete("unknown")
    assert inflight.counts() == {"r2": 2}
    now[0] = 30.0
    inflight.assign("d", "r1")
    inflight.drop("r2")  # a replica that left takes its requests with it
    assert inflight.counts() == {"r1": 1}
    now[0] = 60.0
    inflight.assign("e", "r2")
    now[0] = 95.0  # "d" was never completed (cancelled before it was sent): forgotten after ttl_s
    assert inflight.counts() == {"r2": 1}


def test_prompt_text_covers_messages_prompts_and_ids():
    class R:
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        prompt = None
        prompt_token_ids = None

    assert prompt_text(R()) == "<system>S\n<user>U\n"
    R.messages, R.prompt = None, "hello"
    assert prompt_text(R()) == "hello"
    R.prompt, R.prompt_token_ids = None, [1, 2]
    assert prompt_text(R()) == "1,2"
    R.messages = ["hi", {"role": "user", "content": "U"}]  # malformed (the replica refuses it): still no error
    assert prompt_text(R()) == "<>hi\n<user>U\n"
    R.messages = [object()]
    assert prompt_text(R()) == "<>" + str(R.messages[0]) + "\n"
    assert prompt_text({"prompt": "a dict, not a record"}) == ""
