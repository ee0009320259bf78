"""``dmtd bench engine``: HF generate vs our engine at τ=1 vs DMTD τ=2..4, side by side, with roofline bounds."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dmtd.bench import oracle_bench as ob
from dmtd.bench.exact_bench import add_exact_ratios, chat_prompts, plot_exact, run_exact
from dmtd.bench.roofline import measure_rates
from dmtd.engine import lowbit
from dmtd.engine.config import EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import RequestError, SamplingParams
from dmtd.variants.loader import load_model

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "faster and more cheaply than ever before. Within decades, presses spread across Europe, and "
)


def prompt_ids(tokenizer: Any, length: int) -> list[int]:
    ids = list(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))
    while len(ids) < length:
        ids += ids
    return ids[:length]


def bench_hf(path: Path, ids: list[int], batch: int, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s of HF ``generate`` (greedy): (t(N+1) − t(1)) over N·batch tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    x = torch.tensor([ids] * batch)

    def run(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
            best = min(best, time.perf_counter() - t)
        return best

    return new_tokens * batch / (run(new_tokens + 1) - run(1))


def bench_engine(engine: LLMEngine, ids: list[int], batch: int, tau: int, new_tokens: int, repeats: int) -> dict:
    best: dict[str, Any] = {"tok_s": 0.0}
    for _ in range(repeats):
        res = engine.generate([ids] * batch, SamplingParams(max_new_tokens=new_tokens + 1, tau=tau,
                                                            ignore_eos=True))
        t = max(r.decode_time_s for r in res)
        tok_s = sum(len(r.token_ids) - 1 for r in res) / t
        if tok_s > best["tok_s"]:
            best = {"tok_s": tok_s, "mean_block_len": sum(r.mean_block_len for r in res) / len(res)}
    return best


def bench_prefill(engine: LLMEngine, tokenizer: Any, length: int, repeats: int) -> float:
    """Prompt tokens per second of one ``length``-token prompt's prefill (to its first token), best of repeats."""
    ids = prompt_ids(tokenizer, length)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        engine.generate([ids], SamplingParams(max_new_tokens=1, ignore_eos=True))
        best = min(best, time.perf_counter() - t)
    return length / best


def run_engine_bench(args: argparse.Namespace) -> dict:
    from dmtd.bench import precision_bench as pb

    taus = [int(t) for t in str(args.taus).split(",") if t]
    batches = [int(b) for b in str(args.batch_sizes).split(",") if b]
    if args.draft_threshold is not None and not 0.0 <= args.draft_threshold <= 1.0:  # NaN fails too
        raise RequestError("--draft-threshold", f"must be in [0, 1], got {args.draft_threshold}")
    precisions = pb.parse_precisions(args.precisions)
    acceptances = ob.parse_acceptances(getattr(args, "oracle_acceptance", ""))
    oracle_tau = int(getattr(args, "oracle_tau", 3))
    if acceptances and oracle_tau < 2:
        raise RequestError("--oracle-tau", f"must be at least 2 (a cycle with drafts), got {oracle_tau}")
    if acceptances and args.exact_precision not in precisions + ["float32"]:
        raise RequestError("--oracle-acceptance", f"its rows run at --exact-precision ({args.exact_precision}), "
                           f"which --precisions ({','.join(precisions)}) must name")
    reference = not getattr(args, "no_reference", False)
    if not reference and (args.llama_cpp or not args.no_hf):
        raise RequestError("--no-reference", "the HF and llama.cpp rows are judged against float32: add --no-hf and "
                           "leave out --llama-cpp")
    if "float32" not in precisions and reference:
        precisions = ["float32", *precisions]  # the reference every ratio and quality figure is taken against
    device = getattr(args, "device", "cpu")
    on_cpu = torch.device(device).type == "cpu"
    if not on_cpu and (args.llama_cpp or not args.no_hf):
        raise RequestError("--device", f"{device}: the HF and llama.cpp rows run on the CPU only; add --no-hf "
                           "and leave out --llama-cpp")
    load_format = getattr(args, "load_format", "auto")
    if load_format == "dummy" and (args.llama_cpp or not args.no_hf):
        raise RequestError("--load-format", "dummy: the HF and llama.cpp rows read the model's own weights; add "
                           "--no-hf and leave out --llama-cpp")
    llm = pb.llama_cpp_model(torch.get_num_threads(), args.prompt_len + args.new_tokens + 512) if args.llama_cpp \
        else None
    torch.manual_seed(0)
    rates, streams = None, {}
    if on_cpu:  # the roofline bounds are the CPU's (its memory bandwidth and matmul throughput)
        print("measuring this machine's memory bandwidth and matmul throughput ...")
        rates = measure_rates()
        print(f"  copy {rates.copy_gb_s:.1f} GB/s, batch-1 matvec {rates.matvec_gb_s:.1f} GB/s, "
              f"fp32 matmul {rates.matmul_gflop_s:.0f} GFLOP/s")
        streams = {p: pb.stream_gb_s(p) for p in precisions}
        print("  weight streaming per format (GB/s): " + ", ".join(f"{p} {v:.1f}" for p, v in streams.items()))
    if on_cpu and args.variant != "none" and args.exact_taus and lowbit.draft_format(
            "int8" if "int8" in str(args.draft_quants).split(",") else "auto") is not None:
        streams["i8dot"] = pb.stream_gb_s("i8dot")  # the exact profile's drafts (EngineConfig.draft_quant)
        gw = {p: streams[p] / pb.WEIGHT_BYTES[p] for p in ("bfloat16", "i8dot") if p in streams}
        print("  weights per second at one row (G/s): " + ", ".join(f"{p} {v:.1f}" for p, v in gw.items())
              + "  (i8dot: the exact profile's drafts)")
    context = args.prompt_len + args.new_tokens // 2
    rows: list[dict[str, Any]] = []
    quality: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
    judge, model_cfg = None, None
    path = None
    prefill_lens = [int(x) for x in str(getattr(args, "prefill_lens", "") or "").split(",") if x]
    # the pool holds max_num_seqs × max_len positions: at a 1.7B shape and batch 64, 512 spare positions a row were
    # 7 GiB more of float32 KV
    max_len = max([args.prompt_len + args.new_tokens + 64, 128 + args.quality_tokens] + [n + 8 for n in prefill_lens])
    oracle: list[dict[str, Any]] = []
    for prec in precisions:
        tau_max = max(taus + [1] + ([oracle_tau] if acceptances and prec == args.exact_precision else []))
        engine, lm = pb.build(args.model, prec, max(batches + [args.quality_prompts]), max_len, args.decoding_layers,
                              tau_max, device=device, load_format=load_format,
                              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto") if prec == "bfloat16" else "auto")
        if prec == "float32" and reference:
            judge = lm.model
        path, model_cfg = lm.path, lm.config
        cfg, dmtd = lm.config, engine.dmtd
        ids = prompt_ids(lm.tokenizer, args.prompt_len)
        engine.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        systems = (["hf"] if prec == "float32" and not args.no_hf else []) + ["engine"] + [f"dmtd{t}" for t in taus]
        jobs = [(b, s) for b in batches for s in systems]
        for b, system in tqdm(jobs, desc=f"bench engine ({prec})", unit="config"):
            tau = 1 if system in ("hf", "engine") else int(system[4:])
            bnd = pb.bound(cfg, dmtd if tau > 1 else None, tau, b, context, prec, rates, streams[prec]) \
                if rates is not None else {"bound_tok_s": float("nan")}
            if system == "hf":
                assert path is not None
                r = {"tok_s": bench_hf(path, ids, b, args.new_tokens, args.repeats), "mean_block_len": 1.0}
            else:
                r = bench_engine(engine, ids, b, tau, args.new_tokens, args.repeats)
            rows.append({"batch": b, "system": system, "tau": tau, "precision": prec, **r, **bnd})
        if acceptances and prec == args.exact_precision:
            oracle += ob.oracle_section(engine, ids, batches, oracle_tau, acceptances, prec, args.new_tokens,
                                        args.repeats, context, rates, streams)
        for n in prefill_lens:
            rows.append({"batch": 1, "system": f"prefill{n}", "tau": 1, "precision": prec,
                         "prefill_tok_s": bench_prefill(engine, lm.tokenizer, n, args.repeats)})
        if reference:
            quality[prec] = pb.greedy_chats(engine, args.quality_prompts, args.quality_tokens)
        del engine, lm
        gc.collect()  # the engine's parts refer to one another: without it the next precision's model came on top
    if llm is not None:
        assert judge is not None and rates is not None  # llama.cpp runs on the CPU only
        tok = load_model(args.model).tokenizer
        ids = prompt_ids(tok, args.prompt_len)
        print("llama.cpp (the package's GGUF) ...")
        tok_s = pb.bench_llama_cpp(llm, ids, args.new_tokens, args.repeats)
        rows.append({"batch": 1, "system": "llama.cpp", "tau": 1, "precision": "gguf-q4_1", "tok_s": tok_s,
                     "mean_block_len": 1.0, **pb.bound(judge.config, None, 1, 1, context, "int4", rates,
                                                      streams.get("int4") or rates.matvec_gb_s)})
        prompts = quality["float32"][0]
        quality["llama.cpp"] = (prompts, [pb.llama_generate(llm, p, args.quality_tokens) for p in prompts])
    prefill_rows = [r for r in rows if "prefill_tok_s" in r]
    rows = [r for r in rows if "prefill_tok_s" not in r]
    add_ratios(rows, batches)
    assert model_cfg is not None
    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, **(rates.to_dict() if rates is not None else {}),
                    "stream_gb_s": streams, "device": device,
                    "gpu": torch.cuda.get_device_name(torch.device(device)) if not on_cpu else None},
        "model": str(path), "load_format": load_format, "num_layers": model_cfg.num_layers,
        "decoding_layers": args.decoding_layers,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "precisions": precisions, "rows": rows,
        "quality": {"prompts": args.quality_prompts, "new_tokens": args.quality_tokens,
                    "by_precision": pb.quality_rows(quality, judge)} if judge is not None else None,
        "exact": None,
        "prefill": prefill_rows,
        "oracle": {"precision": args.exact_precision, "tau": oracle_tau, "rows": oracle} if oracle else None,
    }
    print_table(result)  # before the exact rows, which load another model: a failure there keeps these figures
    ob.print_oracle_table(oracle, args.exact_precision)
    for pr in prefill_rows:
        print(f"prefill of {pr['system'][7:]} tokens, {pr['precision']}: {pr['prefill_tok_s']:.0f} prompt tok/s")
    del judge
    exact_rows, variant = exact_section(args, batches)
    result["exact"] = {"variant": variant, "rows": exact_rows} if exact_rows else None
    if exact_rows:
        print_exact_table(result["exact"])
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        plot_path = Path(args.plot) if args.plot else path.with_suffix(".png")
        plot(result, plot_path)
        print(f"wrote {path} and {plot_path}")
        if oracle:
            oracle_png = plot_path.with_name(plot_path.stem + "_oracle.png")
            ob.plot_oracle(oracle, f"{model_title(result)}: verified cycles of τ = {oracle_tau}, oracle drafts, "
                           f"{args.exact_precision}", oracle_png)
            print(f"wrote {oracle_png}")
        if exact_rows:
            exact_png = plot_path.with_name(plot_path.stem + "_exact.png")
            plot_exact(result["exact"], exact_png)
            print(f"wrote {exact_png}")
    return result


def exact_section(args: argparse.Namespace, batches: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Exact-profile rows on the variant (verified cycles), each batch with its verifier-alone τ = 1 row."""
    from dmtd.variants.build import build_engine, engine_spec
    from dmtd.variants.paths import SHIPPED_VARIANTS

    names = sorted(p.parent.name for p in SHIPPED_VARIANTS.glob("*/variant.json"))
    dummy = getattr(args, "load_format", "auto") == "dummy"
    name = args.variant or (names[0] if names and not dummy else "none")  # the shipped variant is SmolLM2's
    taus = [int(t) for t in str(args.exact_taus).split(",") if t]
    if name == "none" or not taus:
        return [], None
    from dmtd.bench.precision_bench import dtype_quant

    dtype, quant = dtype_quant(args.exact_precision)
    device = getattr(args, "device", "cpu")
    spec = engine_spec(args.model, name, dtype=getattr(torch, dtype), device=device, search_dirs=[SHIPPED_VARIANTS],
                       load_format="dummy" if dummy else "auto")
    threshold = spec.draft_threshold if args.draft_threshold is None else args.draft_threshold
    dqs = [q for q in str(args.draft_quants).split(",") if q] or ["auto"]
    ecfg = EngineConfig(max_num_seqs=max(batches), max_model_len=1024, dtype=dtype, quant=quant, device=device)
    engines = {dq: build_engine(spec, dataclasses.replace(ecfg, draft_quant=dq)) for dq in dqs}
    autos = {dq: build_engine(spec, dataclasses.replace(ecfg, adaptive_drafts=True, draft_quant=dq)) for dq in dqs}
    for e in [*engines.values(), *autos.values()]:
        e.generate(chat_prompts(1), SamplingParams(max_new_tokens=4, tau=2, exact=True))  # warm-up
    rows = []
    tau_auto = max(taus + [spec.dmtd.tau_max])
    jobs = [(b, 1, False, dqs[0]) for b in batches]
    jobs += [(b, t, False, dq) for b in batches for dq in dqs for t in taus]
    jobs += [(b, tau_auto, True, dq) for b in batches for dq in dqs]
    # the repeats in rounds, every configuration once a round (best kept): a drift of the machine's speed over the
    # bench (±10 % between runs a minute apart here) then reaches every configuration alike, where repeats back to
    # back gave the configurations run last a slower or faster machine than the base they are divided by
    best: dict[int, dict[str, Any]] = {}
    rounds: dict[int, list[float]] = {i: [] for i in range(len(jobs))}  # each round's tok/s, for paired ratios
    with tqdm(total=len(jobs) * (1 + max(1, args.repeats)), desc="bench engine (exact)", unit="run") as bar:
        # every configuration once untimed first, as a server has run it a while: the kernels' shapes, and the
        # batch gate's verdict at that batch size (a fresh engine measures drafts against plain steps in windows
        # of 4 steps until two readings agree, ~6 windows: a tenth of a 64-token run, a one-off of a server's day)
        for b, tau, adaptive, dq in jobs:
            run_exact((autos if adaptive else engines)[dq], b, tau, threshold, args.new_tokens, 1)
            bar.update()
        for _ in range(max(1, args.repeats)):
            for i, (b, tau, adaptive, dq) in enumerate(jobs):
                r = run_exact((autos if adaptive else engines)[dq], b, tau, threshold, args.new_tokens, 1)
                rounds[i].append(r["tok_s"])
                if i not in best or r["tok_s"] > best[i]["tok_s"]:
                    best[i] = r
                bar.update()
    for i, (b, tau, adaptive, dq) in enumerate(jobs):
        e = (autos if adaptive else engines)[dq]
        label = (f"auto{tau}" if adaptive else f"exact{tau}") + (f":{dq}" if len(dqs) > 1 and tau > 1 else "")
        rows.append({"batch": b, "system": label, "tau": tau, "adaptive_drafts": adaptive,
                     "draft_format": e.runner.draft_format or "engine", **best[i], "tok_s_rounds": rounds[i]})
    add_exact_ratios(rows)
    engine = engines[dqs[0]]
    from dmtd.engine.ops import kernel_path

    return rows, {"name": name, "verifier": engine.verifier_name, "draft_vocab": len(spec.draft_vocab or []) or None,
                  "precision": args.exact_precision, "kernel_path": kernel_path() if device == "cpu" else None}


def print_exact_table(exact: dict[str, Any]) -> None:
    v = exact["variant"]
    path = f"; kernel path {v['kernel_path']}" if v.get("kernel_path") else ""
    print(f"\nexact profile on {v['name']} (verifier: {v['verifier']}; chat prompts, greedy; output = τ = 1's{path}; "
          f"tail c: a draft pass ÷ a τ = 1 step of the same batch)")
    print(f"{'batch':>5} {'system':>12} {'tok/s':>8} {'×τ=1':>6} {'paired':>6} {'bound×':>7} {'of bound':>9} "
          f"{'accept':>7} {'acc/cyc':>7} {'tail c':>7} {'check c':>7} {'gate':>7}")
    for r in exact["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        g = r["gate_windows"]  # the best run's windows measuring (drafts against plain steps) of all it ran
        gate = f"{sum(n for k, n in g.items() if k not in ('drafts pay', 'plain pays', 'neighbour'))}/{sum(g.values())}"
        tail = f"{r['tail_cost']:.2f}" if r["tail_cost"] is not None else "-"
        print(f"{r['batch']:>5} {r['system']:>12} {r['tok_s']:>8.1f} {r['speedup_vs_tau1']:>6.2f} "
              f"{r['paired_vs_tau1']:>6.2f} "
              f"{r['bound_speedup']:>7.2f} {100 * r['pct_of_bound']:>8.0f}% {acc:>7} {r['accepted_per_cycle']:>7.2f} "
              f"{tail:>7} {r['check_cost']:>7.2f} {gate if g else '-':>7}")


def add_ratios(rows: list[dict[str, Any]], batches: list[int]) -> None:
    """Per batch: speedups over the same precision's engine τ = 1 (with its bound's), over fp32 τ = 1 (without a
    float32 row: the first precision's), over HF."""
    for b in batches:
        engines = [r for r in rows if r["batch"] == b and r["system"] == "engine"]
        fp32 = next((r for r in engines if r["precision"] == "float32"), engines[0])
        hf = next((r for r in rows if r["batch"] == b and r["system"] == "hf"), None)
        for r in rows:
            if r["batch"] != b:
                continue
            own = next((x for x in rows if x["batch"] == b and x["system"] == "engine"
                        and x["precision"] == r["precision"]), fp32)
            r["speedup_vs_engine_tau1"] = r["tok_s"] / own["tok_s"]
            r["bound_speedup"] = r["bound_tok_s"] / own["bound_tok_s"]
            r["pct_of_bound_speedup_ratio"] = r["speedup_vs_engine_tau1"] / r["bound_speedup"]
            r["pct_of_bound"] = r["tok_s"] / r["bound_tok_s"]
            r["speedup_vs_fp32_tau1"] = r["tok_s"] / fp32["tok_s"]
            if hf is not None:
                r["speedup_vs_hf"] = r["tok_s"] / hf["tok_s"]
    llama = next((r for r in rows if r["system"] == "llama.cpp"), None)
    if llama is not None:
        for r in rows:
            if r["batch"] == 1:
                r["speedup_vs_llama_cpp"] = r["tok_s"] / llama["tok_s"]


def print_table(result: dict) -> None:
    print(f"\n{'batch':>5} {'precision':>10} {'system':>9} {'tok/s':>8} {'×τ=1':>6} {'×fp32':>6} {'×llama':>7} "
          f"{'bound':>8} {'of bound':>9} {'bound×':>6} {'of bnd×':>7} {'GB/tok':>6} {'block':>6}")
    for r in result["rows"]:  # bound×: the bound's speedup over τ = 1; of bnd×: the measured speedup's share of it
        lc = f"{r['speedup_vs_llama_cpp']:.2f}" if "speedup_vs_llama_cpp" in r else "-"
        print(f"{r['batch']:>5} {r['precision']:>10} {r['system']:>9} {r['tok_s']:>8.1f} "
              f"{r['speedup_vs_engine_tau1']:>6.2f} {r['speedup_vs_fp32_tau1']:>6.2f} {lc:>7} "
              f"{r['bound_tok_s']:>8.1f} {100 * r['pct_of_bound']:>8.0f}% {r['bound_speedup']:>6.2f} "
              f"{100 * r['pct_of_bound_speedup_ratio']:>6.0f}% {r.get('bytes_per_token', 0) / 1e9:>6.3f} "
              f"{r['mean_block_len']:>6.2f}")
    q = result["quality"]
    if q is None:
        return
    print(f"\nquality vs fp32 ({q['prompts']} chat prompts, {q['new_tokens']} greedy tokens, τ = 1)")
    print(f"{'precision':>10} {'agree':>6} {'1st diff':>8} {'identical':>9} {'judge ppl':>9} {'×fp32':>6}")
    for name, r in q["by_precision"].items():
        print(f"{name:>10} {100 * r['agree_prefix_frac']:>5.0f}% {r['first_divergence_median']:>8.0f} "
              f"{r['identical']:>9.0f} {r['judge_ppl']:>9.3f} {r['judge_ppl_ratio']:>6.2f}")


def model_title(result: dict) -> str:
    name = "SmolLM2-135M" if "smollm2" in Path(result["model"]).name else Path(result["model"]).name
    return name + (", random weights" if result.get("load_format") == "dummy" else "")


def plot(result: dict, path: Path) -> None:
    """Per batch: tokens/s × fp32 τ = 1 for every precision and system (llama.cpp at batch 1), bounds as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    colours = {"float32": "#3b7dd8", "bfloat16": "#2f9e6e", "int8": "#d8893b", "int4": "#c0504d",
               "gguf-q4_1": "#777777"}
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == b]
        engines = [r for r in sel if r["system"] == "engine"]
        fp32 = next((r for r in engines if r["precision"] == "float32"), engines[0])["tok_s"]
        xs = range(len(sel))
        ax.bar(xs, [r["tok_s"] / fp32 for r in sel], color=[colours.get(r["precision"], "#999") for r in sel])
        ax.plot(xs, [r["bound_tok_s"] / fp32 for r in sel], "k_", markersize=14, mew=2, label="roofline bound")
        ax.set_xticks(list(xs), [f"{r['precision'].replace('bfloat16', 'bf16').replace('float32', 'fp32')}\n"
                                 f"{r['system'].replace('dmtd', 'τ=').replace('engine', 'τ=1')}" for r in sel],
                      fontsize=7)
        ax.set_title(f"batch {b}")
        ax.set_ylabel(f"decode tokens/s × {rows[0]['precision']} τ = 1")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0][0].legend(loc="upper left")
    m = result["machine"]
    where = m["gpu"] if m.get("gpu") else f"CPU {m['threads']} threads"
    fig.suptitle(f"{model_title(result)} by precision, D={result['decoding_layers']}, {where} (one run)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
