"""Decode speed of one engine by the thread that builds it and the thread that steps it (OpenMP pools).

OpenMP (libgomp, as in torch's CPU wheels) gives every thread that opens a parallel region a pool of its
own. With two pools on a machine with as many cores as one pool has threads, libgomp manages more threads
than cores and stops spinning between parallel regions: each region then pays a futex wake-up. A replica
that built its engine on one thread and stepped it on another ran at about half speed; it now builds and
steps it on the same thread (dmtd.serve.engine_loop). This measures the three arrangements in one process
each, in turn (``--rounds`` times, a fresh process each time), best of ``--repeats`` requests per process and
best over the rounds:

    .venv/bin/python scripts/bench_engine_threads.py --variant smollm2-135m-dmtd --new-tokens 48 --repeats 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = {"main": "built and stepped on the main thread",
         "split": "built on the main thread, stepped on a worker thread (the replica before)",
         "worker": "built and stepped on one worker thread (the replica now)"}


def one(case: str, variant: str, new_tokens: int, repeats: int, batch: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    from dmtd.engine.sequence import SamplingParams
    from dmtd.serve.app import EngineFactory

    ex = ThreadPoolExecutor(1)
    factory = EngineFactory(variant=variant, max_num_seqs=max(16, batch))
    eng, _ = ex.submit(factory).result() if case == "worker" else factory()

    def run(it: int) -> float:
        for i in range(batch):
            eng.add_request([{"role": "user", "content": f"Explain how vaccines work ({i})."}],
                            SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, cycle_len=1),
                            req_id=f"r{it}-{i}")
        eng.step()  # prefill
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished():
            n += sum(1 for o in eng.step() if o.token_id >= 0)
        dt = time.perf_counter() - t0
        for i in range(batch):
            eng.release(f"r{it}-{i}")
        return n / dt

    step_on = (lambda f, *a: f(*a)) if case == "main" else (lambda f, *a: ex.submit(f, *a).result())
    return max(step_on(run, k) for k in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="smollm2-135m-dmtd")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one case, in a child process
    a = ap.parse_args()
    if a.case:
        print(json.dumps(one(a.case, a.variant, a.new_tokens, a.repeats, a.batch_size)))
        return
    from tqdm import tqdm

    results = dict.fromkeys(CASES, 0.0)
    for _, case in tqdm([(r, c) for r in range(a.rounds) for c in CASES], desc="engine threads", unit="case"):
        out = subprocess.run([sys.executable, __file__, "--case", case, "--variant", a.variant, "--new-tokens",
                              str(a.new_tokens), "--repeats", str(a.repeats), "--batch-size", str(a.batch_size)],
                             check=True, capture_output=True, text=True).stdout
        results[case] = max(results[case], float(out.strip().splitlines()[-1]))
    for case, tps in results.items():
        print(f"{tps:7.1f} tok/s  {tps / results['main']:.2f}×  {case}: {CASES[case]}")


if __name__ == "__main__":
    main()
