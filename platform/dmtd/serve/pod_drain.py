"""A serving pod's drain before it stops (its ``preStop`` hook, as the operator renders it): the gateway of an ingress
pod drains (not ready at once, new calls refused, its streams in flight finish), and the hook returns once nothing is
in flight on the pod — the gateway's streams and the replica's batch and queue alike — so that the kubelet's SIGTERM,
which stops Ray on the pod, cuts no stream.

Why a file: the gateway is a Ray actor's process, which neither a signal (Ray's worker owns the main thread) nor a
route of its public HTTP server (any client could drain it) should stop. A file inside the pod's own filesystem
reaches only what runs in the pod. The gateway watches ``$DMTD_DRAIN_FILE`` (set on ingress pods; no watch without
it), drains when it appears and writes its result beside it; it records its pid beside it too, so that the hook knows
whether a gateway runs in this pod at all.

``python -m dmtd.serve.pod_drain`` is the hook: it exits 0 once the pod is quiet, 1 when ``--timeout-s`` ran out
(the kubelet then goes on with SIGTERM either way)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

DRAIN_FILE_ENV = "DMTD_DRAIN_FILE"
IN_FLIGHT_GAUGES = ("dmtd_inflight_requests", "dmtd_batch_size", "dmtd_queue_depth")
"""Per pod: the gateway's streams in flight, the replica's running batch and its waiting queue."""
log = logging.getLogger("dmtd.gateway")


def done_path(trigger: Path) -> Path:
    return trigger.with_name(trigger.name + ".done")


def pid_path(trigger: Path) -> Path:
    return trigger.with_name(trigger.name + ".pid")


def watch(drain: Callable[[], Awaitable[dict[str, Any]]], period_s: float = 0.2) -> asyncio.Task[None] | None:
    """On the running loop: wait for ``$DMTD_DRAIN_FILE`` to appear, then run ``drain`` and write its result to
    ``<file>.done``; None (no watch) when the variable is unset."""
    path = os.environ.get(DRAIN_FILE_ENV)
    if not path:
        return None
    trigger = Path(path)
    try:
        # a trigger left from an earlier gateway of this pod would drain this new one at once
        for stale in (trigger, done_path(trigger)):
            stale.unlink(missing_ok=True)
        pid_path(trigger).write_text(str(os.getpid()))
    except OSError as e:
        raise OSError(f"{DRAIN_FILE_ENV}={path}: the gateway cannot watch it ({e.strerror})") from e
    return asyncio.get_running_loop().create_task(_watch(trigger, drain, period_s))


async def _watch(trigger: Path, drain: Callable[[], Awaitable[dict[str, Any]]], period_s: float) -> None:
    while not trigger.exists():
        await asyncio.sleep(period_s)
    log.info("drain requested (%s)", trigger)
    result = await drain()
    tmp = done_path(trigger).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(done_path(trigger))


def gateway_running(trigger: Path) -> bool:
    """Whether a gateway that watches ``trigger`` runs in this pod (its recorded pid is alive)."""
    try:
        pid = int(pid_path(trigger).read_text())
    except (OSError, ValueError):
        return False
    return Path(f"/proc/{pid}").exists()


def in_flight(metrics_url: str, timeout_s: float = 2.0) -> int:
    """Streams in flight on the pod by its metrics endpoint: the sum of IN_FLIGHT_GAUGES' samples; 0 when nothing
    answers there (a pod without a replica or a gateway has nothing to drain)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return 0
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IN_FLIGHT_GAUGES:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def drain_pod(trigger: Path | None, metrics_url: str, timeout_s: float, quiet_s: float = 3.0,
              poll_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Drain this pod: trigger the gateway's drain (when one runs here) and wait for its result, then until nothing
    has been in flight for ``quiet_s`` (a request the gateway admitted just before it drained may reach the replica
    a moment later); all within ``timeout_s``. Returns what happened (``quiet``: False when time ran out)."""
    t0 = clock()
    out: dict[str, Any] = {"gateway": None, "quiet": False}
    if trigger is not None and gateway_running(trigger):
        trigger.write_text(str(time.time()))
        while not done_path(trigger).exists() and clock() - t0 < timeout_s:
            time.sleep(poll_s)
        with contextlib.suppress(OSError, ValueError):
            out["gateway"] = json.loads(done_path(trigger).read_text())
    quiet_since: float | None = None
    while clock() - t0 < timeout_s:
        busy = in_flight(metrics_url)
        now = clock()
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        if quiet_since is not None and now - quiet_since >= quiet_s:
            out["quiet"] = True
            break
        time.sleep(poll_s)
    out["seconds"] = round(clock() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmtd.serve.pod_drain",
                                description="A serving pod's preStop: drain its gateway, wait for its streams.")
    p.add_argument("--trigger", default=os.environ.get(DRAIN_FILE_ENV),
                   help=f"the file the pod's gateway watches (default ${DRAIN_FILE_ENV}; none: no gateway here)")
    p.add_argument("--metrics-url", default="http://127.0.0.1:9464/metrics",
                   help="the pod's Prometheus endpoint (gateway and replica gauges)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="give up after this long (the pod's grace period "
                   "less a margin)")
    p.add_argument("--quiet-s", type=float, default=3.0, help="nothing in flight for this long means drained")
    args = p.parse_args(argv)
    if args.timeout_s <= 0 or args.quiet_s < 0 or args.quiet_s >= args.timeout_s:
        p.error("--timeout-s must be > 0 and --quiet-s in [0, timeout-s)")
    out = drain_pod(Path(args.trigger) if args.trigger else None, args.metrics_url, args.timeout_s, args.quiet_s)
    print(json.dumps(out), flush=True)
    return 0 if out["quiet"] else 1


if __name__ == "__main__":
    sys.exit(main())
