"""``min_tokens`` on the OpenAI endpoints as the gateway parses it (no Ray): below max tokens it reaches the replica's
request, at max tokens it is ``ignore_eos`` with no stops, above it a 400 naming it."""

from __future__ import annotations

import json

import pytest

from dmtd.serve.openai_models import parse_body
from dmtd.serve.requests import InvalidRequest, Limits


def _parse(**body: object):
    raw = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 8, "stop": ["."], **body}).encode()
    return parse_body(raw, chat=False, arrival_s=0.0, limits=Limits())[0]


def test_min_tokens_below_max_tokens_reaches_the_replica_request_with_its_stops():
    req = _parse(min_tokens=3)
    assert req.min_tokens == 3 and req.stop == ["."] and not req.ignore_eos


def test_min_tokens_at_max_tokens_is_ignore_eos_without_stops():
    req = _parse(min_tokens=8, stop_token_ids=[5])
    assert req.min_tokens == 0 and req.ignore_eos and req.stop == [] and req.stop_token_ids == []


def test_min_tokens_above_max_tokens_is_refused_naming_it():
    with pytest.raises(InvalidRequest, match="max_tokens") as e:
        _parse(min_tokens=9)
    assert e.value.field == "min_tokens"
