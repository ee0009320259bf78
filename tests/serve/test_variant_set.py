"""The replica's variant bookkeeping (torch-free): resolving a request's variant, in-flight counts, retiring, and the
least recently used idle variants let go to make room under max_variants."""

from __future__ import annotations

import re

import pytest

from dmtd.serve.errors import VariantUnavailable
from dmtd.serve.variant_set import ServedVariant, VariantSet


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def served(name: str, profile: str = "exact") -> ServedVariant:
    return ServedVariant(name, f"/v/{name}", 57_000_000, 0.4, 3, 4, 0.5, profile)


def test_a_request_resolves_to_its_variant_or_is_refused_naming_it_and_why() -> None:
    s = VariantSet("own", max_variants=4)
    s.served["a"] = served("a")
    s.failed["broken"] = "variant 'broken': adapter checksum mismatch"
    s.loading.add("coming")
    assert s.resolve("") is None and s.resolve("own") is None
    assert s.resolve("a") is s.served["a"]
    assert s.resolve("a").profile_of("") == "exact" and served("b", "dmtd").profile_of("") == "adaptive"
    for name, why in (("broken", "adapter checksum mismatch"), ("coming", "still loading"),
                      ("nope", "not loaded here (served: own, a)")):
        with pytest.raises(VariantUnavailable, match=re.escape(why)) as e:
            s.resolve(name)
        assert e.value.variant == name and repr(name) in str(e.value)
    assert s.names() == ["own", "a"]


def test_a_retiring_variant_takes_no_new_request_and_goes_after_its_last() -> None:
    s = VariantSet("own")
    a = s.served["a"] = served("a")
    s.begin(a)
    s.begin(a)
    a.retiring = True
    with pytest.raises(VariantUnavailable, match="retiring"):
        s.resolve("a")
    assert s.end(a) is False and s.end(a) is True  # idle now: the replica lets it go


def test_room_is_made_from_the_least_recently_used_idle_variants() -> None:
    s = VariantSet("own", max_variants=4, clock=Clock())
    for name in ("a", "b"):
        s.served[name] = served(name)
    assert s.to_evict() == []  # own + a + b + one more fit in 4
    s.max_variants = 3
    a, b = s.served["a"], s.served["b"]
    s.begin(b), s.end(b)  # b used after a... then a used last
    s.begin(a), s.end(a)
    assert s.to_evict() == ["b"]
    s.begin(b)  # b busy: a goes although used later
    assert s.to_evict() == ["a"]
    s.begin(a)  # both busy: no room
    assert s.to_evict() is None
    report = s.report()
    assert report["served"]["a"]["inflight"] == 1 and report["max_variants"] == 3
