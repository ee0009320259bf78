"""The operator's RayService run as KubeRay runs it: gateway on the head, replicas on the workers, gRPC and
OpenAI through the head's addresses."""

from __future__ import annotations

from openai import OpenAI

from dmtd.client import DMTDClient
from tests.cluster.cluster import RayCluster


def test_grpc_stream_and_openai_call_through_the_cluster(cluster: RayCluster) -> None:
    gateway = cluster.running_replicas("Gateway")
    replicas = cluster.running_replicas("DMTDReplica")
    assert [r["node_ip"] for r in gateway] == [cluster.head.ip]
    assert len(replicas) == 1 and replicas[0]["node_ip"] in {w.ip for w in cluster.workers}
    with DMTDClient(f"{cluster.head.ip}:9000", timeout_s=120) as c:
        blocks = list(c.generate(messages=[{"role": "user", "content": "Name a colour."}], max_new_tokens=12))
    tokens = [t for b in blocks for t in b.token_ids]
    assert 1 <= len(tokens) <= 12 and blocks[-1].usage.completion_tokens == len(tokens)
    oa = OpenAI(base_url=f"http://{cluster.head.ip}:8000/v1", api_key="unused", timeout=120)
    model = oa.models.list().data[0].id
    chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
    print(f"cluster: nodes ready in {cluster.start_s:.1f} s, app running {cluster.deploy_s:.1f} s after submit")
