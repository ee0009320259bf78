"""bf16 / int8 / int4 weight-only kernels: what they compute, and engines that run on them (attention:
test_attend_kernel.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dmtd.engine import lowbit
from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.ops import KERNEL_PATHS, cpu_paths, kernel_path
from dmtd.engine.sequence import SamplingParams
from tests.conftest import tiny_model

FORMATS = ["bf16", "int8", "int4"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    lowbit.load_kernels()  # compiled once per CPU and torch version, cached under $DMTD_CACHE/kernels


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_error_is_within_half_a_step_of_each_group(fmt):
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 96)  # groups of very different ranges
    p = lowbit.pack(w, fmt)
    back = lowbit.unpack(p)
    err = (back - w).abs().view(48, 3, 32)
    if fmt == "bf16":
        assert (err <= w.abs().view(48, 3, 32) * 2 ** -8 + 1e-30).all()
    elif fmt == "int8":
        step = p.scales.unsqueeze(-1)
        assert (err <= step / 2 + 1e-6).all()
    else:
        step = p.scales[..., :1]
        assert (err <= step / 2 + 1e-6).all()
        assert p.data.dtype == torch.uint8 and p.data.shape == (48, 48)
    assert p.nbytes < w.numel() * 4 * {"bf16": 0.51, "int8": 0.29, "int4": 0.2}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 40])
def test_kernel_equals_the_dense_product_of_the_packed_weight(fmt, rows):
    torch.manual_seed(rows)
    w = torch.randn(70, 128)  # 70 output rows: not a multiple of the kernel's row chunk
    p = lowbit.pack(w, fmt)
    x = torch.randn(rows, 128)
    amx = fmt == "bf16" and lowbit.loaded_path() in ("amx", "avx512bf16")  # activations rounded to bf16
    ref = (x.to(torch.bfloat16).float() if amx else x) @ lowbit.unpack(p).t()
    y = p.project(x)
    assert y.shape == (rows, 70) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=8e-3 if amx else 1e-4, atol=1e-4)
    yb = p.project(x.to(torch.bfloat16).view(rows, 1, 128))  # bf16 activations, any leading shape
    assert yb.dtype == torch.bfloat16 and yb.shape == (rows, 1, 70)
    refb = x.to(torch.bfloat16).float() @ lowbit.unpack(p).t()
    torch.testing.assert_close(yb.float().view(rows, 70), refb, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("fmt", [*FORMATS, "i8dot"])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(fmt):
    """A row's product has the same bits whatever the number of rows in the call (1 .. 70, across the kernels'
    blocks of 8 rows and AMX's tiles of 16), its place among them and the other rows: exactness rests on it."""
    torch.manual_seed(1)
    p = lowbit.pack(torch.randn(80, 128), fmt)  # 80 outputs: a partial block of 32 on AMX
    x = torch.randn(70, 128)
    together = p.project(x)
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 9, 16, 17, 33, 70):
        idx = torch.randperm(70, generator=g)[:n]
        companions = torch.randn(n, 128, generator=g)
        companions[torch.arange(n) % 2 == 0] = x[idx][torch.arange(n) % 2 == 0]
        mixed = p.project(companions)
        for i in range(0, n, 2):
            assert torch.equal(mixed[i], together[idx[i]]), (n, i)


@pytest.mark.parametrize("fmt", [*FORMATS, "i8dot"])
def test_a_prompts_many_rows_get_the_bits_each_gets_alone(fmt):
    """A prompt's prefill runs hundreds of rows a call, which the AMX product takes in chunks of 256 rows and the
    others in blocks: a row keeps the bits it gets alone or among a few — 1 .. 500 rows, across chunk and tile
    boundaries (500 = 31 · 16 + 4), outputs past the last whole block of 32 (80) — and the dense product's value."""
    torch.manual_seed(2)
    p = lowbit.pack(torch.randn(80, 192), fmt)
    x = torch.randn(500, 192)
    many = p.project(x)
    amx = fmt == "bf16" and lowbit.loaded_path() in ("amx", "avx512bf16")
    if fmt in ("bf16", "int8", "int4"):
        ref = (x.to(torch.bfloat16).float() if amx else x) @ lowbit.unpack(p).t()
        torch.testing.assert_close(many, ref, rtol=8e-3 if amx else 1e-4, atol=1e-4)
    for n in (1, 3, 16, 40, 383, 384, 401):
        part = p.project(x[-n:])
        assert torch.equal(part, many[-n:]), n
    assert torch.equal(p.project(x[:1]), many[:1])


@pytest.mark.parametrize("fmt", [*FORMATS, "i8dot"])
def test_the_prefetch_distance_changes_no_bit_and_refuses_a_bad_one(fmt):
    """dmtd::set_prefetch changes how far ahead the weights are fetched, never a value;
    a distance outside 0..65536 is refused naming the rule, and the one before stays."""
    torch.manual_seed(2)
    p = lowbit.pack(torch.randn(300, 256), fmt)
    x = torch.randn(3, 256)
    before = torch.ops.dmtd.set_prefetch(x, 0)
    try:
        none = p.project(x)
        for d in (64, 1024, 4096):
            torch.ops.dmtd.set_prefetch(x, d)
            assert torch.equal(p.project(x), none)
        with pytest.raises(RuntimeError, match="bytes must be in 0..65536"):
            torch.ops.dmtd.set_prefetch(x, -1)
        assert torch.ops.dmtd.set_prefetch(x, 4096) == 4096
    finally:
        torch.ops.dmtd.set_prefetch(x, before)
    assert before == 2048  # the default


def test_the_kernel_path_is_the_fastest_the_cpu_has_unless_forced():
    assert kernel_path() == cpu_paths()[0] or os.environ.get("DMTD_KERNEL_PATH")
    assert lowbit.loaded_path() == kernel_path()
    assert cpu_paths(set()) == ["portable"]
    assert cpu_paths({"avx2", "fma"}) == ["avx2", "portable"]
    assert cpu_paths({"avx512f", "avx512bw", "avx512_bf16", "avx2", "fma"}) == ["avx512bf16", "avx512", "avx2",
                                                                                "portable"]
    assert set(cpu_paths()) <= set(KERNEL_PATHS)
    script = "from dmtd.engine import lowbit; lowbit.load_kernels(); print(lowbit.loaded_path())"
    bad = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DMTD_KERNEL_PATH": "sse9"},
                         capture_output=True, text=True)
    assert bad.returncode != 0
    assert "DMTD_KERNEL_PATH must be auto or one of amx, avx512bf16, avx512, avx2, portable" in bad.stderr
    missing = [p for p in KERNEL_PATHS if p not in cpu_paths()]
    for path in missing[:1]:
        out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DMTD_KERNEL_PATH": path},
                             capture_output=True, text=True)
        assert out.returncode != 0 and f"DMTD_KERNEL_PATH={path}: this CPU runs only" in out.stderr


def test_blocked_bf16_holds_the_same_weights_and_selects_rows(monkeypatch):
    """The avx512bf16 path's blocked layout (16 outputs' input pairs side by side, outputs padded to 16) stands for
    the same bf16 weights as the row-major one; a restricted head taken from it holds the chosen rows."""
    torch.manual_seed(4)
    w = torch.randn(70, 96)
    monkeypatch.setenv("DMTD_KERNEL_PATH", "avx512bf16")
    p = lowbit.pack(w, "bf16")
    monkeypatch.setenv("DMTD_KERNEL_PATH", "portable")
    q = lowbit.pack(w, "bf16")
    assert p.blocked and not q.blocked and p.mode == lowbit.BF16_BLOCKED and q.mode == 1
    assert p.data.shape == (5, 48, 32) and p.data[4, :, 12:].eq(0).all()  # rows 70..79 padded with zeros
    assert p.data[1, 7, 2 * 3 + 1] == w[16 + 3, 2 * 7 + 1].to(torch.bfloat16)
    assert torch.equal(lowbit.unpack(p), lowbit.unpack(q))
    ids = torch.tensor([69, 0, 17, 33])
    monkeypatch.setenv("DMTD_KERNEL_PATH", "avx512bf16")
    r = p.rows(ids)
    assert r.blocked and r.out_features == 4 and torch.equal(lowbit.unpack(r), lowbit.unpack(q)[ids])


def test_bad_shapes_and_formats_are_refused_with_the_rule():
    with pytest.raises(ConfigError, match="multiple of 32"):
        lowbit.pack(torch.randn(8, 40), "int8")
    with pytest.raises(ConfigError, match="weight format must be one of"):
        lowbit.pack(torch.randn(8, 64), "int3")
    with pytest.raises(ConfigError, match="quant must be none, int8 or int4"):
        EngineConfig(quant="int2")
    with pytest.raises(ConfigError, match="needs dtype float32 or bfloat16"):
        EngineConfig(quant="int8", dtype="float64")


DMTD = DMTDConfig(0, 4, 2, tau_max=4)


def _tiny(dtype: torch.dtype = torch.float32):
    return tiny_model(seed=3, hidden_size=64, intermediate_size=128).to(dtype)


def _dequantised_copy(model, fmt: str):
    """The same model with every projection and the (tied) head replaced by what ``fmt`` stores."""
    ref = tiny_model(seed=3, hidden_size=64, intermediate_size=128)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in ref.layers:
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj):
                proj.weight.copy_(lowbit.unpack(lowbit.pack(proj.weight.t(), fmt)).t())
    return ref


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantised_engine_computes_its_dequantised_model(fmt):
    model = _tiny()
    eng = LLMEngine(model, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=128, quant=fmt),
                    default_tau=1, eos_token_ids=[])
    assert eng.runner.weight_format == fmt
    ref_model = _dequantised_copy(model, fmt)
    head = lowbit.unpack(eng.runner.head)  # the packed tied head, as stored
    prompt = list(range(3, 14))
    res = eng.generate([prompt], SamplingParams(max_new_tokens=12, tau=1))[0]
    ids = torch.tensor([prompt + res.token_ids[:-1]])
    with torch.no_grad():
        h = ref_model.run_layers(ref_model.embed_tokens(ids), 0, 6, *ref_model.rope(torch.arange(ids.shape[1])[None]))
        logits = ref_model.norm(h) @ head.t()
    assert logits[0, len(prompt) - 1:].argmax(-1).tolist() == res.token_ids


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tau", [2, 4])
def test_quantised_exact_profile_equals_its_own_tau1_tokens(fmt, tau):
    """Verified cycles on packed weights: the output is the same engine's τ = 1 output, batched or not."""
    model = _tiny()
    eng = LLMEngine(model, None, DMTD, EngineConfig(max_num_seqs=4, max_model_len=128, quant=fmt),
                    default_tau=1, eos_token_ids=[])
    prompts = [list(range(2, 2 + n)) for n in (5, 9, 3)]
    base = eng.generate(prompts, SamplingParams(max_new_tokens=20, tau=1))
    exact = eng.generate(prompts, SamplingParams(max_new_tokens=20, tau=tau, exact=True))
    assert [r.token_ids for r in exact] == [r.token_ids for r in base]
    assert sum(r.num_drafted for r in exact) > 0


def test_bf16_engine_uses_the_packed_kernels_and_refuses_a_model_of_another_dtype():
    eng = LLMEngine(_tiny(torch.bfloat16), None, DMTD, EngineConfig(max_num_seqs=2, max_model_len=64,
                                                                    dtype="bfloat16"),
                    default_tau=1, eos_token_ids=[])
    assert eng.runner.weight_format == "bf16"
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))[0].token_ids) == 5
    with pytest.raises(ConfigError, match="dtype is bfloat16 but the model's weights are float32"):
        LLMEngine(_tiny(), None, DMTD, EngineConfig(dtype="bfloat16"), eos_token_ids=[])


def _dmtd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dmtd", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_cli_refuses_an_unknown_quantisation_and_one_this_machine_cannot_run():
    r = _dmtd("generate", "--prompt", "hi", "--quant", "int3")
    assert r.returncode == 2 and "--quant" in r.stderr and "int4" in r.stderr
    r = _dmtd("generate", "--prompt", "hi", "--dtype", "float16")
    assert r.returncode == 2 and "--dtype" in r.stderr and "bfloat16" in r.stderr
    r = _dmtd("generate", "--prompt", "hi", "--variant", "none", "--quant", "int4", "--max-new-tokens", "2",
              env={"DMTD_LOWBIT_KERNELS": "0"})
    assert r.returncode == 2, r.stderr
    assert "quant 'int4' cannot run here" in r.stderr and "supported on this machine: none" in r.stderr


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_i8dot_is_the_int8_weight_times_activations_rounded_per_block_of_64(rows):
    """The drafts' format: int8 weights with a scale per output row, activations rounded to int8 per block of 64
    by the kernel (AVX512-VNNI dot products where the CPU has them)."""
    torch.manual_seed(rows)
    w = torch.randn(70, 128) * torch.linspace(0.1, 2, 128)
    p = lowbit.pack(w, "i8dot")
    assert p.data.dtype == torch.int8 and p.scales.shape == (70,) and p.nbytes == 70 * 128 + 70 * 4
    x = torch.randn(rows, 128) * torch.linspace(3, 0.01, 128)
    xb = x.view(rows, 2, 64)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = (torch.round(xb * (127 / amax)) * (amax / 127)).view(rows, 128)
    y = p.project(x)
    torch.testing.assert_close(y, xq @ lowbit.unpack(p).t(), rtol=1e-4, atol=1e-3)
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.02
    for i in range(rows):
        assert torch.equal(p.project(x[i: i + 1])[0], y[i])
    with pytest.raises(ConfigError, match="multiple of 64"):
        lowbit.pack(torch.randn(4, 96), "i8dot")


def test_i8dot_reuses_its_activation_buffers_without_carrying_anything_over():
    """The kernel quantises each call's activations into buffers it keeps between calls (a draft pass makes ~40
    products): products of other shapes in between, a block of zeros and values that round at exactly .5 leave
    every result what the rounding rule gives."""
    torch.manual_seed(7)
    big, small = lowbit.pack(torch.randn(48, 192), "i8dot"), lowbit.pack(torch.randn(16, 64), "i8dot")
    x = torch.randn(3, 192)
    x[1, 64:128] = 0.0  # a block with no scale
    x[2, :63] = (torch.arange(63) - 31 + 0.5) / 128  # block max 127/128: the scale is 128, each value x·128 a tie
    x[2, 63] = 127 / 128
    first = big.project(x)
    xb = x.view(3, 3, 64)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (torch.round(xb * scale) * (amax / 127)).view(3, 192)  # torch.round: half to even, as the kernel
    torch.testing.assert_close(first, xq @ lowbit.unpack(big).t(), rtol=1e-4, atol=1e-4)
    for rows in (9, 1, 5):
        small.project(torch.randn(rows, 64) * 100)
        assert torch.equal(big.project(x), first)


@pytest.mark.parametrize("n", [7, 100, 8192, 49152])
def test_top1_is_the_first_argmax_and_its_softmax_probability(n):
    """dmtd::top1, the greedy pick and check of verified cycles in one pass: torch's argmax (the first of tied
    maxima) and the softmax's top probability, NaN for a row holding a NaN or nothing finite."""
    torch.manual_seed(n)
    x = torch.randn(4, n) * 4
    x[0, n // 3] = x[0].max() + 1
    x[0, n // 2] = x[0, n // 3]  # a tie: the first index wins
    x[2, n - 1] = float("nan")
    x[3] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        idx, p = torch.ops.dmtd.top1(xs)
        assert idx[[0, 1]].tolist() == xs[[0, 1]].float().argmax(-1).tolist() and int(idx[0]) == n // 3
        torch.testing.assert_close(p[:2], torch.softmax(xs[:2].float(), -1).amax(-1), rtol=1e-5, atol=1e-7)
        assert torch.isnan(p[2:]).all()


def test_a_build_killed_midway_does_not_hang_later_loads(tmp_path):
    """torch's builder leaves its lock file behind when its process is killed mid-build (Ctrl-C on a first run);
    the next process must not wait on it forever."""
    import shutil

    build = lowbit._build_dir(kernel_path())
    cache = tmp_path / "cache"
    shutil.copytree(build, cache / "kernels" / build.name)  # the built kernels, mtimes kept: nothing to rebuild
    (cache / "kernels" / build.name / "lock").touch()  # what the killed build left
    code = "from dmtd.engine import lowbit; lowbit.load_kernels(); print(lowbit.kernels_loaded())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DMTD_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert not (cache / "kernels" / build.name / "lock").exists()
