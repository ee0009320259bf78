"""Precisions and llama.cpp in ``dmtd bench engine``: what a weight format buys in speed and costs in quality.

Every precision runs the same requests as the fp32 rows, in the same run. Its quality is measured on chat
prompts against fp32, greedy at τ = 1: how many tokens agree before the first divergence, and the judge
perplexity of its text under the fp32 base model (the fp32 row's own is the reference). llama.cpp runs the
GGUF our model package ships (Q4_1), same prompts, same token counts, same thread count, batch 1.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dmtd.bench.exact_bench import chat_prompts
from dmtd.bench.roofline import MachineRates, step_bytes, token_flops
from dmtd.engine import lowbit
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig, ModelConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.smollm2 import gguf_path as smollm2_gguf

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
# bytes a decode step reads per weight (int formats: a float32 scale, and a minimum for int4, per 32 weights)
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.125, "int4": 0.75, "i8dot": 1.0}


def parse_precisions(text: str) -> list[str]:
    out = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [p for p in out if p not in PRECISIONS]
    if bad or not out:
        raise ConfigError(f"--precisions takes a comma list of {', '.join(PRECISIONS)}; got {text!r}")
    return out


def dtype_quant(precision: str) -> tuple[str, str]:
    """A precision's activation dtype and weight quantisation (int formats keep float32 activations)."""
    return (precision, "none") if precision in ("float32", "bfloat16") else ("float32", precision)


def build(model_arg: str | None, precision: str, max_num_seqs: int, max_model_len: int,
          decoding_layers: int, tau_max: int, device: str = "cpu", load_format: str = "auto",
          kv_cache_dtype: str = "auto") -> tuple[LLMEngine, Any]:
    from dmtd.variants.loader import load_model

    dtype, quant = dtype_quant(precision)
    lm = load_model(model_arg, dtype=getattr(torch, dtype), device=device, load_format=load_format)
    dmtd = DMTDConfig.plain(lm.config.num_layers, decoding_layers, tau_max=tau_max)
    engine = LLMEngine(lm.model, lm.tokenizer, dmtd, EngineConfig(max_num_seqs=max_num_seqs,
                                                                  max_model_len=max_model_len, dtype=dtype,
                                                                  quant=quant, device=device,
                                                                  kv_cache_dtype=kv_cache_dtype))
    return engine, lm


def bound(cfg: ModelConfig, dmtd: DMTDConfig | None, tau: int, batch: int, context: int, precision: str,
          rates: MachineRates, stream_gb_s: float) -> dict[str, float]:
    """Roofline bound of a row: the format's weight bytes at the rate its own kernel streams them."""
    w = WEIGHT_BYTES[precision]
    kv_elem = 2 if precision == "bfloat16" else 4

    def step(layers: int) -> float:
        weights = step_bytes(cfg, layers, 0, context, elem=1) * w  # batch 0: weights only
        return weights + step_bytes(cfg, layers, batch, context, elem=kv_elem) - step_bytes(cfg, layers, 0, context,
                                                                                              elem=kv_elem)
    cycle = step(cfg.num_layers)
    if tau > 1 and dmtd is not None:
        cycle += (tau - 1) * step(dmtd.num_encoding_layers + dmtd.num_decoding_layers)
    tokens = batch * max(tau, 1)
    t_mem = cycle / (stream_gb_s * 1e9)
    t_flop = tokens * token_flops(cfg, context) / (rates.gflop_s(precision) * 1e9)  # bf16: its own matmul rate
    return {"bound_tok_s": tokens / max(t_mem, t_flop), "bytes_per_token": cycle / tokens,
            "stream_gb_s": stream_gb_s}


def stream_gb_s(precision: str, working_set_mb: int = 512, repeats: int = 3) -> float:
    """Weight bytes/s of batch-1 products in this format over a set larger than the caches."""
    if precision == "float32":
        mats: list[Any] = [torch.randn(576, 3072) for _ in range(working_set_mb // 7)]
        x = torch.randn(1, 576)

        def run() -> None:
            for m in mats:
                torch.matmul(x, m)
        size = sum(m.numel() * 4 for m in mats)
    else:
        fmt = "bf16" if precision == "bfloat16" else precision
        n = int(working_set_mb * 2 ** 20 / (3072 * 576 * WEIGHT_BYTES[precision]))
        mats = [lowbit.pack(torch.randn(3072, 576), fmt) for _ in range(n)]
        x = torch.randn(1, 576, dtype=torch.bfloat16 if precision in ("bfloat16", "i8dot") else torch.float32)

        def run() -> None:
            for m in mats:
                m.project(x)
        size = sum(m.nbytes for m in mats)
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return size / best / 1e9


# -- quality -----------------------------------------------------------------------------------------------
def greedy_chats(engine: LLMEngine, n_prompts: int, new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [engine.encode(p) for p in chat_prompts(n_prompts)]
    res = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, tau=1, ignore_eos=True))
    return prompts, [r.token_ids for r in res]


@torch.inference_mode()
def judge_nll(model: Any, prompts: list[list[int]], outs: list[list[int]]) -> float:
    """Mean NLL per generated token under ``model`` (full causal pass; its exp is the judge perplexity)."""
    total, count = 0.0, 0
    L = model.config.num_layers
    plain = DMTDConfig.plain(L, 1, tau_max=1)
    device = next(model.parameters()).device
    for p, g in zip(prompts, outs):
        ids = torch.tensor([p + g], device=device)
        logits = model.forward_masked(ids, torch.ones_like(ids, dtype=torch.bool), plain)[0].float()
        lp = torch.log_softmax(logits[len(p) - 1: -1], -1)
        total -= lp.gather(1, torch.tensor(g, device=device)[:, None]).sum().item()
        count += len(g)
    return total / max(count, 1)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """First-divergence statistics of greedy outputs against the reference's."""
    firsts = []
    for a, b in zip(ref, got):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    n = len(ref[0]) if ref else 0
    firsts.sort()
    return {"agree_prefix_frac": sum(firsts) / max(n * len(firsts), 1),
            "first_divergence_median": float(firsts[len(firsts) // 2]) if firsts else 0.0,
            "first_divergence_min": float(firsts[0]) if firsts else 0.0,
            "identical": float(sum(f == n for f in firsts))}


# -- llama.cpp ---------------------------------------------------------------------------------------------
def llama_cpp_model(threads: int, n_ctx: int) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ConfigError("--llama-cpp needs llama-cpp-python: run `make bench-deps` (builds it once for this "
                          "CPU, ~15 minutes)") from e
    import llama_cpp.llama_cpp as lib

    # No extra buffer types (ggml's weight repacking, AMX among them): on a CPU with AMX, ggml's AMX matmul
    # crashed (SIGSEGV in ggml_backend_amx_mul_mat) when it ran on the OpenMP pool that torch's libgomp had
    # already started in this process; standalone it ran. Batch-1 decoding is a matrix-vector product, which
    # AMX tiles do not speed up.
    default_params = lib.llama_model_default_params

    def plain_params() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain_params
    try:
        return Llama(model_path=str(smollm2_gguf()), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                     n_batch=512, verbose=False)
    finally:
        lib.llama_model_default_params = default_params


def llama_generate(llm: Any, ids: list[int], n: int) -> list[int]:
    """Greedy tokens (EOS ignored: exactly ``n``), from a fresh context."""
    out: list[int] = []
    llm.reset()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) >= n:
            break
    return out


def bench_llama_cpp(llm: Any, ids: list[int], new_tokens: int, repeats: int) -> float:
    """Decode tokens/s, as for HF generate: (t(N+1) − t(1)) over N tokens, best of ``repeats``."""
    def run(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            llama_generate(llm, ids, n)
            best = min(best, time.perf_counter() - t)
        return best
    return new_tokens / (run(new_tokens + 1) - run(1))


def quality_rows(results: dict[str, tuple[list[list[int]], list[list[int]]]], judge: Any) -> dict[str, dict]:
    """Per precision (and llama.cpp): agreement with fp32 and judge perplexity under the fp32 model."""
    ref_prompts, ref = results["float32"]
    out: dict[str, dict] = {}
    for name, (prompts, outs) in results.items():
        nll = judge_nll(judge, prompts, outs)
        out[name] = {**agreement(ref, outs), "judge_ppl": math.exp(nll)}
    base = out["float32"]["judge_ppl"]
    for q in out.values():
        q["judge_ppl_ratio"] = q["judge_ppl"] / base
    return out
