"""An ingress or worker pod's preStop (dmtd.serve.pod_drain): the gateway drains when the trigger file appears and
writes its result beside it; the hook waits for that result, then until the pod's metrics show nothing in flight for
a quiet spell; a pod without a gateway or a metrics endpoint has nothing to wait for; bad flags are refused."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dmtd.serve import pod_drain

METRICS = """# HELP dmtd_inflight_requests Streams in flight at the gateway.
# TYPE dmtd_inflight_requests gauge
dmtd_inflight_requests{{deployment="d"}} {gateway}
dmtd_batch_size{{deployment="d",variant="v",replica="r"}} {batch}
dmtd_queue_depth{{deployment="d",variant="v",replica="r"}} 0.0
dmtd_requests_total{{deployment="d",variant="v",code="OK"}} 7.0
"""


class Pod:
    """A metrics endpoint whose gauges the test sets."""

    def __init__(self) -> None:
        self.gateway, self.batch = 0, 0
        pod = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = METRICS.format(gateway=float(pod.gateway), batch=float(pod.batch)).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def gateway_thread(trigger: Path, pod: Pod, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Thread, list[str]]:
    """A gateway's watch on its own event loop: its drain ends its one stream and reports it."""
    monkeypatch.setenv(pod_drain.DRAIN_FILE_ENV, str(trigger))
    calls: list[str] = []
    ready = threading.Event()

    async def drain() -> dict[str, Any]:
        calls.append("drain")
        await asyncio.sleep(0.3)
        pod.gateway = 0  # its stream finished
        return {"in_flight": 1, "cut": 0, "seconds": 0.3}

    async def main() -> None:
        task = pod_drain.watch(drain, period_s=0.02)
        ready.set()
        assert task is not None
        await task

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    ready.wait(5)
    return t, calls


def test_the_hook_drains_the_gateway_then_waits_until_the_pod_is_quiet(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    trigger = tmp_path / "drain"
    trigger.write_text("left by an earlier gateway")  # removed by the new gateway's watch, not obeyed
    pod = Pod()
    pod.gateway, pod.batch = 1, 1
    gateway, calls = gateway_thread(trigger, pod, monkeypatch)
    assert not trigger.exists() and pod_drain.gateway_running(trigger) and calls == []
    assert pod_drain.in_flight(pod.url) == 2
    threading.Timer(0.8, lambda: setattr(pod, "batch", 0)).start()  # the replica's last sequence ends later
    t = time.monotonic()
    out = pod_drain.drain_pod(trigger, pod.url, timeout_s=10, quiet_s=0.5, poll_s=0.05)
    took = time.monotonic() - t
    gateway.join(5)
    assert calls == ["drain"] and out["gateway"] == {"in_flight": 1, "cut": 0, "seconds": 0.3}
    assert out["quiet"] and 0.8 + 0.5 <= took < 5, (out, took)
    assert json.loads(pod_drain.done_path(trigger).read_text())["in_flight"] == 1


def test_a_pod_without_a_gateway_or_metrics_has_nothing_to_wait_for_and_a_busy_one_times_out(tmp_path: Path) -> None:
    out = pod_drain.drain_pod(tmp_path / "drain", "http://127.0.0.1:9/metrics", timeout_s=5, quiet_s=0.1,
                              poll_s=0.02)
    assert out["gateway"] is None and out["quiet"] and out["seconds"] < 2
    assert not (tmp_path / "drain").exists()  # no gateway watches it: nothing written
    pod = Pod()
    pod.batch = 3
    busy = pod_drain.drain_pod(None, pod.url, timeout_s=0.5, quiet_s=0.1, poll_s=0.02)
    assert busy["quiet"] is False and busy["seconds"] >= 0.5
    assert pod_drain.main(["--metrics-url", pod.url, "--timeout-s", "0.3", "--quiet-s", "0.1"]) == 1


def test_no_watch_without_the_variable_and_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(pod_drain.DRAIN_FILE_ENV, raising=False)

    async def no_drain() -> dict[str, Any]:
        raise AssertionError("not called")

    async def main() -> object:
        return pod_drain.watch(no_drain)

    assert asyncio.run(main()) is None
    monkeypatch.setenv(pod_drain.DRAIN_FILE_ENV, "/nonexistent-dir/drain")
    with pytest.raises(OSError, match="DMTD_DRAIN_FILE=/nonexistent-dir/drain: the gateway cannot watch it"):
        asyncio.run(main())
    with pytest.raises(SystemExit) as e:
        pod_drain.main(["--timeout-s", "5", "--quiet-s", "9"])
    assert e.value.code == 2 and "--quiet-s in [0, timeout-s)" in capsys.readouterr().err
