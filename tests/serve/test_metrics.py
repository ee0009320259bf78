"""Scrape the gateway's and the replica's Prometheus endpoints around known traffic: counts and sums add up."""

from __future__ import annotations

import threading
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from dmtd.client import DMTDClient
from dmtd_contract import metric_names as m
from tests.serve.conftest import VARIANT
from tests.serve.test_stack import wait_idle


def scrape(url: str) -> dict[str, float]:
    """Samples summed over label sets, keyed by sample name and by ``name{label=value}`` for each label."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] += s.value
            for k, v in s.labels.items():
                if k != "le":
                    out[f"{s.name}{{{k}={v}}}"] += s.value
    return out


def urls(stack) -> tuple[str, str]:
    gw, rep = stack.gateway_info()["metrics_url"], stack.replica_stats()["metrics_url"]
    assert gw and rep and gw != rep
    return gw, rep


def concurrent_streams(stack, requests: list[dict]) -> dict[int, list]:
    """Each request's blocks, the requests streamed at the same time (one client and thread each)."""
    streams: dict[int, list] = {}

    def run(i: int) -> None:
        with DMTDClient(stack.grpc_target) as c:
            streams[i] = list(c.generate(**requests[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return streams


def test_counts_and_sums_match_the_traffic(stack):
    gw_url, rep_url = urls(stack)
    wait_idle(stack)
    g0, r0 = scrape(gw_url), scrape(rep_url)
    streams = concurrent_streams(stack, [dict(prompt=f"Fact {i}:", max_new_tokens=10 + i, ignore_eos=True, tau_min=1,
                                              tau_max=3) for i in range(3)])
    wait_idle(stack)
    g1, r1 = scrape(gw_url), scrape(rep_url)

    def d(after: dict, before: dict, key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(b.k for s in streams.values() for b in s)
    blocks = sum(len(s) for s in streams.values())
    first_k = sum(s[0].k for s in streams.values())
    assert tokens == 10 + 11 + 12
    lab = f"{{replica={stack.replica_stats()['replica']}}}"
    assert d(r1, r0, "dmtd_generated_tokens_total") == tokens == d(r1, r0, "dmtd_generated_tokens_total" + lab)
    assert d(r1, r0, "dmtd_block_length_sum") == tokens
    assert d(r1, r0, "dmtd_block_length_count") == blocks
    assert d(r1, r0, "dmtd_head_steps_total") + d(r1, r0, "dmtd_tail_steps_total") == tokens
    assert d(r1, r0, "dmtd_head_steps_total") >= 3  # at least the prefill's token of each request
    assert d(r1, r0, "dmtd_request_gpu_seconds_count") == 3 and d(r1, r0, "dmtd_request_gpu_seconds_sum") > 0
    by_tau = sum(v for k, v in r1.items() if k.startswith("dmtd_block_length_count{tau="))
    assert by_tau == r1["dmtd_block_length_count"]
    assert d(r1, r0, "dmtd_engine_steps_total{kind=prefill}") >= 1
    taus = {b.tau for st in streams.values() for b in st}
    assert all(d(r1, r0, f"dmtd_busy_cost_usd_total{{tau={t}}}") > 0 for t in taus)

    assert d(g1, g0, "dmtd_ttft_seconds_count") == 3 == d(g1, g0, f"dmtd_ttft_seconds_count{{variant={VARIANT}}}")
    assert d(g1, g0, "dmtd_itl_seconds_count") == tokens - first_k
    assert d(g1, g0, "dmtd_end_to_end_seconds_count") == 3
    assert d(g1, g0, "dmtd_requests_total{code=OK}") == 3
    assert d(g1, g0, "dmtd_ttft_seconds_sum") > 0 and d(g1, g0, "dmtd_itl_seconds_sum") > 0
    # itl_slo_ms is 5000 in the test stack and the TTFT SLO 2 s: every request here is compliant or only
    # the TTFT decides
    assert 0 <= d(g1, g0, "dmtd_slo_compliant_requests_total") <= 3


def test_gauges_and_every_documented_metric_is_exported(stack):
    gw_url, rep_url = urls(stack)
    with DMTDClient(stack.grpc_target) as c:  # one verified cycle at least: the exact profile's series exist
        list(c.generate(prompt="Fact:", max_new_tokens=3, ignore_eos=True, tau_min=2, tau_max=2, profile="exact"))
    wait_idle(stack)
    g, r = scrape(gw_url), scrape(rep_url)
    assert g["dmtd_inflight_requests"] == 0 and g["dmtd_replicas_ready"] >= 1
    assert r["dmtd_queue_depth"] == 0 and r["dmtd_batch_size"] == 0 and r["dmtd_kv_cache_occupancy"] == 0
    assert 1 <= r["dmtd_tau_min"] <= r["dmtd_tau"] <= r["dmtd_tau_max"] <= 4
    assert 0 <= r["dmtd_cpu_utilization"] <= 1
    assert r["dmtd_cost_usd_per_hour{replica_type=cpu}"] > 0 and r["dmtd_cost_usd_total"] > 0
    exported = {k.split("{")[0] for k in (*g, *r)}
    gpu_only = {m.GPU_UTILIZATION.name, m.GPU_MEMORY_USED_BYTES.name}
    for metric in m.ALL:
        if metric.name in gpu_only:
            continue
        names = {metric.name, metric.name + "_count"} if metric.kind == "histogram" else {metric.name}
        assert names & exported, f"{metric.name} is documented but not exported"
    # each metric comes from one kind of process only, so a sum over all targets never double counts
    assert not ({k.split("{")[0] for k in g} & {k.split("{")[0] for k in r})
