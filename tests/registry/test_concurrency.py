"""No lost update: several clients in threads promote, retire, set weights and tune the same entries at once."""

from __future__ import annotations

import threading
from collections import defaultdict

from dmtd_contract.registry import RegistryClient, VariantEntry
from tests.registry.conftest import spec

NUM_VARIANTS = 4
ROUNDS = 4


def test_concurrent_writers_lose_no_update(registry_url: str) -> None:
    names = [f"v{i}" for i in range(NUM_VARIANTS)]
    with RegistryClient(registry_url) as setup:
        for n in names:
            setup.register(spec(n))
    results: list[tuple[str, str, VariantEntry]] = []  # (writer kind, name, entry the write produced)
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def writer(kind: str, t: int) -> None:
        try:
            with RegistryClient(registry_url) as client:
                start.wait()
                for r in range(ROUNDS):
                    for i, n in enumerate(names):
                        unique = (1000 * t + 10 * r + i + 1) / 100_000  # every write changes something
                        if kind == "weight":
                            got = client.set_weight(n, unique)
                        elif kind == "tune":
                            got = client.update(n, min_confidence=unique)
                        elif i % 2 != t % 2:  # each lifecycle writer owns half of the variants
                            continue
                        else:
                            got = client.promote(n) if r % 2 == 0 else client.retire(n)
                        with lock:
                            results.append((kind, n, got))
                if kind == "lifecycle":  # leave every variant active
                    for i, n in enumerate(names):
                        if i % 2 == t % 2:
                            with lock:
                                results.append((kind, n, client.promote(n)))
        except BaseException as e:  # noqa: B036 - collected and re-raised in the main thread
            errors.append(e)

    kinds = [("weight", 0), ("weight", 1), ("tune", 2), ("tune", 3), ("lifecycle", 0), ("lifecycle", 1)]
    threads = [threading.Thread(target=writer, args=k) for k in kinds]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)

    total = len(results)
    assert total == 2 * ROUNDS * NUM_VARIANTS * 2 + ROUNDS * NUM_VARIANTS + NUM_VARIANTS
    global_revisions = sorted(e.registry_revision for _, _, e in results)
    assert global_revisions == list(range(NUM_VARIANTS + 1, NUM_VARIANTS + total + 1)), "one revision per write"

    with RegistryClient(registry_url) as client:
        assert client.revision() == NUM_VARIANTS + total
        by_name: dict[str, list[tuple[str, VariantEntry]]] = defaultdict(list)
        for kind, n, e in results:
            by_name[n].append((kind, e))
        for n in names:
            final = client.get(n)
            history = sorted(by_name[n], key=lambda ke: ke[1].registry_revision)
            assert final.revision == 1 + len(history), f"{n}: an entry revision was lost"
            assert sorted(e.revision for _, e in history) == list(range(2, 2 + len(history)))
            last_weight = max((e for k, e in history if k == "weight"), key=lambda e: e.registry_revision)
            last_tune = max((e for k, e in history if k == "tune"), key=lambda e: e.registry_revision)
            assert final.traffic_weight == last_weight.traffic_weight, f"{n}: a weight update was lost"
            assert final.min_confidence == last_tune.min_confidence, f"{n}: a min_confidence update was lost"
            assert final.status == "active", f"{n}: a promotion was lost"
            assert final == history[-1][1]
