"""``dmtd generate`` and ``dmtd bench engine`` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def dmtd(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dmtd", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_generate_json_plain_model(smollm2):
    r = dmtd("generate", "--variant", "none", "--chat", "What is the capital of France?", "--greedy",
             "--max-new-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"prompt_token_ids", "token_ids", "text", "tokens_per_s", "mean_block_len"} <= out.keys()
    assert "Paris" in out["text"] and out["tokens_per_s"] > 0 and out["mean_block_len"] == 1.0
    assert out["text"] == smollm2.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_generate_streams_dmtd_split_and_reports_blocks():
    r = dmtd("generate", "--variant", "none", "--decoding-layers", "8", "--tau", "3", "--prompt",
             "Once upon a time", "--max-new-tokens", "18", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 18 and out["block_lens"] == [3] * 6 and out["mean_block_len"] == 3.0
    r = dmtd("generate", "--variant", "none", "--decoding-layers", "8", "--tau", "3", "--prompt",
             "Once upon a time", "--max-new-tokens", "12")
    assert r.returncode == 0 and "tok/s decode" in r.stdout and "mean block 3.00" in r.stdout


def test_generate_compare_tau1_reports_the_speedup_over_the_same_request(smollm2):
    r = dmtd("generate", "--chat", "Name three colours.", "--max-new-tokens", "16", "--tau", "3",
             "--min-confidence", "0.5", "--compare-tau1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tau"] == 3 and out["min_confidence"] == 0.5
    assert out["tau1_tokens_per_s"] > 0
    assert out["speedup_vs_tau1"] == pytest.approx(out["tokens_per_s"] / out["tau1_tokens_per_s"])
    # the shipped variant's default profile is exact: its twin is the base model's own engine
    assert "speedup" in r.stderr and "τ=1 on the base model" in r.stderr
    # which writes what the shipped variant's τ = 1 (the verifier at every position) writes: one token a block
    plain = dmtd("generate", "--chat", "Name three colours.", "--max-new-tokens", "16", "--tau", "1",
                 "--min-confidence", "0", "--json")
    ref = json.loads(plain.stdout.strip().splitlines()[-1])
    assert out["tau1_token_ids"] == ref["token_ids"] and ref["block_lens"] == [1] * len(ref["token_ids"])
    # against a server --compare-tau1 is taken too (tests/serve/test_exact_surface.py): here none answers
    r = dmtd("generate", "--server", "127.0.0.1:1", "--prompt", "hi", "--compare-tau1")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "Traceback" not in r.stderr


def test_generate_repeat_alternates_the_runs_and_compares_the_fastest():
    r = dmtd("generate", "--profile", "exact", "--chat", "Name three colours.", "--max-new-tokens", "12", "--tau", "2",
             "--compare-tau1", "--repeat", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["runs_each"] == 2 and out["tokens_match_tau1"] is True
    assert out["speedup_vs_tau1"] == pytest.approx(out["tokens_per_s"] / out["tau1_tokens_per_s"])
    assert "fastest of 2 runs each" in r.stderr
    # bad input: exit 2 naming the flag and its rule, before any model is loaded
    for bad, rule in ((["--compare-tau1", "--repeat", "0"], "--repeat must be at least 1"),
                      (["--repeat", "2"], "--repeat applies only with --compare-tau1"),
                      (["--server", "127.0.0.1:1", "--compare-tau1", "--repeat", "2"], "not --server")):
        r = dmtd("generate", "--chat", "hi", *bad)
        assert r.returncode == 2 and rule in r.stderr and "Traceback" not in r.stderr


def test_generate_profile_exact_says_its_tokens_are_tau1s():
    r = dmtd("generate", "--profile", "exact", "--chat", "Name three colours.", "--max-new-tokens", "24", "--tau", "3",
             "--min-confidence", "0", "--drafts", "fixed", "--compare-tau1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["profile"] == "exact" and out["verifier"] == "base" and out["num_drafted"] > 0
    assert out["drafts"] == "fixed"
    assert out["tokens_match_tau1"] is True and out["token_ids"] == out["tau1_token_ids"]
    # the twin is the base model's own engine (--variant none), not the variant's τ = 1 path
    assert "tokens identical to the base model's (--variant none) (base model)" in r.stderr
    assert "τ=1 on the base model" in r.stderr and "drafts accepted" in r.stderr
    # the default, adaptive drafts: the count that pays at this machine's measured costs (maybe none), the
    # same tokens
    auto = dmtd("generate", "--profile", "exact", "--chat", "Name three colours.", "--max-new-tokens", "24", "--tau",
                "3", "--min-confidence", "0", "--compare-tau1", "--json")
    assert auto.returncode == 0, auto.stderr
    a = json.loads(auto.stdout.strip().splitlines()[-1])
    assert a["drafts"] == "adaptive" and "adaptive drafts" in auto.stderr
    assert a["tokens_match_tau1"] is True and a["token_ids"] == out["token_ids"]
    assert 0 <= a["num_context_accepted"] <= a["num_context_drafted"] <= a["num_drafted"]  # context drafts: a part
    assert out["num_context_drafted"] == 0  # fixed drafts: the tails' only
    tails = dmtd("generate", "--profile", "exact", "--chat", "Name three colours.", "--max-new-tokens", "24", "--tau",
                 "3", "--min-confidence", "0", "--no-context-drafts", "--json")
    t = json.loads(tails.stdout.strip().splitlines()[-1])
    assert tails.returncode == 0 and t["num_context_drafted"] == 0 and t["token_ids"] == out["token_ids"]
    lookups = dmtd("generate", "--profile", "exact", "--chat", "Name three colours.", "--max-new-tokens", "24",
                   "--tau", "3", "--min-confidence", "0", "--no-phrase-drafts", "--json")  # prompt lookups and tails
    lk = json.loads(lookups.stdout.strip().splitlines()[-1])
    assert lookups.returncode == 0 and lk["token_ids"] == out["token_ids"]
    assert 0 <= lk["num_context_accepted"] <= lk["num_context_drafted"] <= lk["num_drafted"]
    from dmtd.engine.lowbit import resolve_dtype

    assert out["dtype"] == resolve_dtype("auto", "cpu")  # auto precision: bfloat16 on AVX-512, the exact profile too
    # and τ = 1 of the exact profile is the base model itself (in the same precision)
    base = dmtd("generate", "--variant", "none", "--chat", "Name three colours.", "--max-new-tokens", "24", "--json",
                "--dtype", out["dtype"])
    assert json.loads(base.stdout.strip().splitlines()[-1])["token_ids"] == out["token_ids"]


def test_generate_several_chats_one_after_another_and_sums_them_up():
    msgs = ["Name three colours.", "Say hello in French."]
    r = dmtd("generate", "--profile", "exact", "--chat", msgs[0], "--chat", msgs[1], "--max-new-tokens", "12",
             "--tau", "2", "--compare-tau1", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert len(lines) == 2 and all(x["tokens_match_tau1"] is True for x in lines)
    assert lines[0]["prompt_token_ids"] != lines[1]["prompt_token_ids"]
    mean = sum(x["speedup_vs_tau1"] for x in lines) / 2
    assert f"2 requests: speedup over τ = 1 mean {mean:.2f}×" in r.stderr
    assert "tokens identical to the base model's in 2 of 2" in r.stderr
    # each one is what the same request alone writes
    one = dmtd("generate", "--profile", "exact", "--chat", msgs[1], "--max-new-tokens", "12", "--tau", "2", "--json")
    assert json.loads(one.stdout.strip().splitlines()[-1])["token_ids"] == lines[1]["token_ids"]


@pytest.mark.parametrize("args,words", [
    (["--profile", "exact", "--prompt", "hi", "--min-confidence", "1.5"], "min_confidence: must be in [0, 1]"),
    (["--profile", "fast", "--prompt", "hi"], "--profile: invalid choice"),
    (["--variant", "none", "--prompt", "hi", "--tau", "2"], "tau: must be in 1..1"),
    (["--variant", "none", "--decoding-layers", "8", "--prompt", "hi", "--tau", "9"], "tau: must be in 1..8"),
    (["--variant", "none", "--decoding-layers", "30", "--prompt", "hi"], "decoding_layers must be in 1..29"),
    (["--model", "/nonexistent/model", "--variant", "none", "--prompt", "hi"], "not a directory"),
    (["--variant", "none", "--prompt", ""], "prompt: must not be empty"),
    (["--variant", "none"], "one of --prompt or --chat"),
    (["--variant", "no-such-variant", "--prompt", "hi"], "not found"),
    (["--variant", "none", "--prompt", "hi", "--top-p", "0"], "top_p"),
    # checked before any work: before the (absent) model would load, before the (absent) server is reached
    (["--model", "/nonexistent/model", "--variant", "none", "--prompt", "hi", "--min-confidence", "1.5"],
     "min_confidence: must be in [0, 1], got 1.5"),
    (["--server", "127.0.0.1:1", "--profile", "exact", "--prompt", "hi", "--min-confidence", "-0.1"],
     "min_confidence: must be in [0, 1], got -0.1"),
    (["--server", "127.0.0.1:1", "--prompt", "hi", "--tau", "0"], "tau: must be >= 1"),
    (["--profile", "quality", "--prompt", "hi"], "--profile quality: the replica controller's profiles"),
    (["--server", "127.0.0.1:1", "--chat", "hi", "--chat", "there"], "--chat: one message with --server"),
])
def test_bad_input_exits_2_naming_the_problem(args, words):
    r = dmtd("generate", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr


def test_bench_engine_writes_json_and_png(tmp_path: Path):
    path = tmp_path / "bench.json"
    r = dmtd("bench", "engine", "--batch-sizes", "1,2", "--taus", "2", "--new-tokens", "6", "--prompt-len", "16",
             "--repeats", "1", "--exact-taus", "2", "--precisions", "float32,int8", "--quality-prompts", "2",
             "--quality-tokens", "8", "--llama-cpp", "--json", str(path), timeout=900)
    assert r.returncode == 0, r.stderr
    data = json.loads(path.read_text())
    exact = data["exact"]
    assert exact["variant"]["verifier"] == "base"
    want = {(b, s) for b in (1, 2) for s in ("exact1", "exact2", "auto4")}
    assert {(row["batch"], row["system"]) for row in exact["rows"]} == want
    for row in exact["rows"]:
        assert row["tok_s"] > 0 and 0 < row["pct_of_bound"] <= 1.0 and row["check_cost"] > 0
        # one round: the paired ratio is that round's, the best-of ratio's run
        assert len(row["tok_s_rounds"]) == 1 and row["paired_vs_tau1"] == pytest.approx(row["speedup_vs_tau1"])
        if row["system"] == "exact1":
            assert row["paired_vs_tau1"] == 1.0
        # the batch gate runs windows only for the adaptive default at batch > 1 (one sequence always drafts)
        assert bool(row["gate_windows"]) == (row["system"] == "auto4" and row["batch"] == 2), row
        if row["system"] == "exact2":
            assert row["acceptance"] is not None and 0 <= row["acceptance"] <= 1 and row["tail_cost"] > 0
    systems = {(row["batch"], row["precision"], row["system"]) for row in data["rows"]}
    assert systems == {(b, p, s) for b in (1, 2) for p in ("float32", "int8") for s in ("engine", "dmtd2")} | {
        (1, "float32", "hf"), (2, "float32", "hf"), (1, "gguf-q4_1", "llama.cpp")}
    for row in data["rows"]:
        assert row["tok_s"] > 0 and row["bound_tok_s"] > 0
        if row["system"] == "dmtd2":
            assert 1.0 < row["bound_speedup"] < 2.0
        if row["batch"] == 1:  # every batch-1 row is set against llama.cpp's, measured in the same run
            assert row["speedup_vs_llama_cpp"] > 0
    int8 = next(r for r in data["rows"] if r["precision"] == "int8" and r["system"] == "engine" and r["batch"] == 1)
    fp32 = next(r for r in data["rows"] if r["precision"] == "float32" and r["system"] == "engine" and r["batch"] == 1)
    assert int8["bytes_per_token"] < 0.3 * fp32["bytes_per_token"]
    quality = data["quality"]["by_precision"]
    assert set(quality) == {"float32", "int8", "llama.cpp"}
    assert quality["float32"]["agree_prefix_frac"] == 1.0 and quality["float32"]["judge_ppl_ratio"] == 1.0
    for q in quality.values():
        assert 0 <= q["agree_prefix_frac"] <= 1 and q["judge_ppl"] > 1
    assert data["machine"]["matvec_gb_s"] > 0
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert path.with_name(path.stem + "_exact.png").stat().st_size > 10_000


def test_make_demo_answers_the_exact_benchmarks_chat_prompts():
    """`make demo` shows the shipped default's speedup over τ = 1 as a mean over the chat prompts the exact-profile
    benchmarks measure (no training corpus holds them), not one prompt; the Makefile lists them verbatim."""
    import re
    from pathlib import Path

    from dmtd.bench.exact_bench import CHATS

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    block = makefile[makefile.index("DEMO_CHATS :="): makefile.index("\n\n", makefile.index("DEMO_CHATS :="))]
    assert re.findall(r'--chat "([^"]+)"', block) == CHATS
    assert "$(DEMO_CHATS)" in makefile and "--compare-tau1" in makefile
