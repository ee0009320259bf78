"""Profile the serving stack under load with py-spy: the replica, the gateway and the load generator.

Starts ``dmtd bench serve`` (its own stack, one closed-loop run), waits until the load is on, samples each
process of that stack with ``py-spy record --format raw`` for a while, and prints, per process, where its
samples sit: the top leaf frames (self time) and the top frames anywhere on the stack (inclusive), by thread.

    .venv/bin/python scripts/profile_serve.py --concurrency 16 --policy tau1 --seconds 20 --out artifacts/pyspy
    .venv/bin/python scripts/profile_serve.py --summarize artifacts/pyspy/replica.txt   # a raw file again
    .venv/bin/python scripts/profile_serve.py --cpu-only --seconds 20   # CPU per process only, no py-spy

Every run also prints the CPU each process of the stack used over the sampling window (its share of one
core, from /proc; the engine, the gateway, Ray's own daemons, the load generator), since on two cores
every daemon's share is taken from the engine.

Needs py-spy (the dev extra) and ptrace rights over the stack's processes (root, or ptrace_scope 0). With
``--gil``, only samples holding the GIL count (what contends for the interpreter); ``--idle`` keeps idle
threads' samples too; ``--native`` adds C/C++ frames (torch, OpenMP), at a larger sampling cost.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROLES = {"replica": "ray::ServeReplica:dmtd:DMTDReplica", "gateway": "ray::ServeReplica:dmtd:Gateway"}


def descendants(pid: int) -> list[tuple[int, str]]:
    import psutil

    try:
        return [(p.pid, " ".join(p.cmdline())) for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def find_roles(bench_pid: int) -> dict[str, int]:
    found = {"client": bench_pid}
    for pid, cmd in descendants(bench_pid):
        for role, name in ROLES.items():
            if cmd.startswith(name):
                found[role] = pid
    return found


def frame_name(frame: str) -> str:
    """``fn (file.py:12)`` → ``fn (file.py)``: lines of one function together."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def summarize(path: Path, top: int = 18) -> str:
    """Self and inclusive shares of the samples of one raw py-spy file, per thread and overall."""
    total = 0
    by_thread: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else ""
        frames = [frame_name(f) for f in frames[1:] if f] if thread else [frame_name(f) for f in frames]
        total += count
        by_thread[thread] += count
        if frames:
            leaf[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    out = [f"{path.name}: {total} samples"]
    for t, n in by_thread.most_common(8):
        out.append(f"  thread {t or '?'}: {n / total:.0%}")
    out.append("  self (leaf frame):")
    out += [f"    {n / total:6.1%}  {f}" for f, n in leaf.most_common(top)]
    out.append("  inclusive:")
    out += [f"    {n / total:6.1%}  {f}" for f, n in incl.most_common(top)]
    return "\n".join(out)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def process_label(cmd: str) -> str:
    """A short, stable name for one process of the stack."""
    head = cmd.split()[0] if cmd.split() else "?"
    if head.startswith("ray::"):
        return head
    for part in cmd.split():
        base = os.path.basename(part)
        if base.endswith((".py", "_server", "raylet", "redis-server")) or base in ("dmtd",):
            return base
    return os.path.basename(head)


def cpu_by_process(root: int, seconds: float) -> list[tuple[str, float]]:
    """Each process under ``root`` (and ``root``): the share of one core it used over ``seconds``."""
    procs = [(root, "load generator (dmtd bench serve)"), *descendants(root)]
    before = {pid: cpu_seconds(pid) for pid, _ in procs}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    shares: collections.Counter[str] = collections.Counter()
    for pid, cmd in procs:
        label = cmd if pid == root else process_label(cmd)
        shares[label] += max(0.0, cpu_seconds(pid) - before[pid]) / wall
    return shares.most_common()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--policy", default="tau1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests-per-worker", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=20, help="how long py-spy samples each process")
    ap.add_argument("--rate", type=int, default=100, help="samples per second")
    ap.add_argument("--warmup", type=float, default=6.0, help="seconds of load before sampling starts")
    ap.add_argument("--gil", action="store_true")
    ap.add_argument("--idle", action="store_true")
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--out", default="artifacts/pyspy")
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU per process, without py-spy")
    ap.add_argument("--summarize", nargs="*", default=None, help="only print the summaries of these raw files")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: more `dmtd bench serve` arguments")
    args = ap.parse_args()
    if args.summarize is not None:
        for p in args.summarize:
            print(summarize(Path(p)))
        return 0
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dmtd = str(Path(sys.executable).with_name("dmtd"))
    extra = [a for a in args.bench_args if a != "--"]
    cmd = [dmtd, "bench", "serve", "--concurrency", str(args.concurrency), "--policies", args.policy,
           "--max-new-tokens", str(args.max_new_tokens), "--requests-per-worker", str(args.requests_per_worker),
           *extra]
    log = (out / "bench.log").open("w")
    bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        roles: dict[str, int] = {}
        while bench.poll() is None and not {"replica", "gateway"} <= set(roles):
            time.sleep(1.0)
            roles = find_roles(bench.pid)
        text = ""
        while bench.poll() is None and "bench serve:" not in text:  # the warm-up request is done
            time.sleep(0.5)
            text = (out / "bench.log").read_text(errors="replace")
        time.sleep(args.warmup)
        flags = ["--nonblocking", "-r", str(args.rate), "-d", str(int(args.seconds)), "-f", "raw", "-t"]
        flags += ["--gil"] * args.gil + ["--idle"] * args.idle + ["--native"] * args.native
        spies = {} if args.cpu_only else {
            role: subprocess.Popen([spy, "record", *flags, "-p", str(pid), "-o", str(out / f"{role}.txt")],
                                   stdout=(out / f"{role}.log").open("w"), stderr=subprocess.STDOUT)
            for role, pid in roles.items()}
        shares = cpu_by_process(bench.pid, args.seconds)
        for p in spies.values():
            p.wait()
        bench.wait()
    finally:
        if bench.poll() is None:
            bench.terminate()
    print(f"pids: {roles}")
    print(f"CPU over {args.seconds} s (share of one core; py-spy's own sampling adds to the sampled ones):")
    for label, share in shares:
        if share >= 0.005:
            print(f"  {share:6.1%}  {label}")
    print(f"  {sum(s for _, s in shares):6.1%}  all")
    for role in roles:
        f = out / f"{role}.txt"
        if f.exists():
            print(summarize(f))
    return bench.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
