"""The built-in web dashboard in headless chromium against the real stack: it loads, every asset is local,
its charts fill after traffic, no console errors; the screenshot is kept under artifacts/."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from dmtd.client import DMTDClient
from tests.serve.conftest import VARIANT
from tests.telemetry.cdp import Browser, chromium_executable

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
INSTALL_HINT = "chromium is missing: run scripts/install-chromium.sh (apt-get install chromium)"


@pytest.fixture
def browser():
    exe = chromium_executable()
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    b = Browser(exe)
    yield b
    b.close()


def test_stats_endpoint_and_assets_are_local(stack):
    page = urllib.request.urlopen(stack.http_url + "/dashboard", timeout=10).read().decode()
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(r.startswith("/dashboard/assets/") or r.startswith("data:") for r in refs), refs
    js = urllib.request.urlopen(stack.http_url + "/dashboard/assets/dashboard.js", timeout=10).read().decode()
    assert "http://" not in js and "https://" not in js and "import " not in js
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(stack.http_url + "/dashboard/assets/..%2F__init__.py", timeout=10)
    assert e.value.code == 404
    stats = json.loads(urllib.request.urlopen(stack.http_url + "/dashboard/stats", timeout=10).read())
    assert {"variants", "series", "slo", "usd_per_replica_hour"} <= stats.keys()


def exact_totals(stack) -> tuple[int, int]:
    stats = json.loads(urllib.request.urlopen(stack.http_url + "/dashboard/stats", timeout=10).read())
    exact = stats["variants"].get(VARIANT, {}).get("exact") or {"accepted": 0, "drafted": 0}
    return exact["accepted"], exact["drafted"]


def test_dashboard_in_headless_chromium(stack, browser):
    accepted0, drafted0 = exact_totals(stack)  # the gateway counts since it started: earlier tests' too
    with DMTDClient(stack.grpc_target) as c:
        for i in range(3):
            list(c.generate(prompt=f"Dashboard traffic {i}:", max_new_tokens=12, ignore_eos=True, tau_min=2,
                            tau_max=3))
        exact = list(c.generate(prompt="Dashboard traffic, verified:", max_new_tokens=12, ignore_eos=True,
                                tau_min=3, tau_max=3, min_confidence=0.0, profile="exact"))
    browser.navigate(stack.http_url + "/dashboard")
    ready = browser.wait_for(
        f"document.querySelector('.card[data-variant=\"{VARIANT}\"]') !== null && "
        "['chart-k', 'chart-tau', 'chart-latency', 'chart-throughput'].every("
        "id => Number(document.getElementById(id).dataset.points || 0) > 0) && "
        "Number(document.getElementById('chart-acceptance').dataset.groups || 0) > 0")
    charts = browser.evaluate("JSON.stringify(Object.fromEntries(['chart-k', 'chart-tau', 'chart-latency', "
                              "'chart-throughput'].map(id => [id, document.getElementById(id).dataset.points])))")
    shot = browser.screenshot(ARTIFACTS / "dashboard.png")
    assert ready, f"charts stayed empty: {charts}"
    card = browser.evaluate(f"Object.fromEntries([...document.querySelectorAll('.card[data-variant=\"{VARIANT}\"] "
                            "td.v')].map(td => [td.dataset.key, td.textContent]))")
    assert card["usd"].startswith("$") and float(card["tok-s"]) > 0 and card["tau"] in ("1", "2", "3", "4")
    # the exact request's drafts: accepted / drafted on the card, by tail position on the chart (τ = 3: two)
    drafted, accepted = drafted0 + sum(b.num_drafted for b in exact), accepted0 + sum(b.num_accepted for b in exact)
    assert drafted > drafted0 and card["exact-acceptance"].startswith(f"{accepted} / {drafted} (")
    assert exact_totals(stack) == (accepted, drafted)
    assert int(browser.evaluate("document.getElementById('chart-acceptance').dataset.groups")) >= 2
    # a canvas with content is not blank: some pixel differs from the background
    painted = browser.evaluate("(() => { const c = document.getElementById('chart-k'); "
                               "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; "
                               "let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; })()")
    assert painted > 500
    assert browser.errors() == []
    assert shot.stat().st_size > 20000
