"""``dmtd bench serve --against vllm`` without vLLM: the rows, ratios, table and JSON from saved client results,
the client's command line, and the arguments a run refuses (exit code 2, naming the option)."""

from __future__ import annotations

import argparse
import json

import pytest

from dmtd.bench import vllm_anchor as va
from dmtd.bench.serve_bench import add_bench_serve_args, run_bench_serve

# the figures `vllm bench serve --save-result --metric-percentiles 50,99` writes, trimmed
VLLM = {"completed": 8, "failed": 0, "total_input_tokens": 400, "total_output_tokens": 512, "duration": 4.0,
        "output_throughput": 128.0, "mean_ttft_ms": 50.0, "p50_ttft_ms": 40.0, "p50_itl_ms": 8.0, "p99_itl_ms": 20.0,
        "p50_tpot_ms": 8.0}
OURS = {**VLLM, "output_throughput": 192.0, "mean_ttft_ms": 100.0, "p50_ttft_ms": 80.0, "p50_itl_ms": 16.0,
        "p99_itl_ms": 10.0, "p50_tpot_ms": 4.0}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    return p.parse_args(argv)


def test_chat_prompts_are_the_exact_benchmarks():
    from dmtd.bench.exact_bench import CHATS

    assert list(va.CHAT_PROMPTS) == CHATS


def test_rows_ratios_table_and_json(tmp_path, capsys):
    plan = va.workloads([1, 16], 3, 64, tmp_path / "chats.jsonl")
    assert [(w["workload"], w["concurrency"], w["num_prompts"]) for w in plan] == [
        ("chat", 1, 8), ("chat", 16, 48), ("prefix", 4, 32)]
    rows = va.make_rows({"vllm": [VLLM] * 3, "dmtd": [OURS] * 3}, plan)
    r = rows[0]
    assert r["vllm"]["tokens_per_s"] == 128.0 and r["dmtd"]["output_tokens"] == 512
    assert r["ratio"] == {"tokens_per_s": 1.5, "ttft_mean_ms": 2.0, "ttft_p50_ms": 2.0, "itl_p50_ms": 2.0,
                          "itl_p99_ms": 0.5, "tpot_p50_ms": 0.5}
    assert va.ratios({"tokens_per_s": 1.0}, {"tokens_per_s": 0.0})["tokens_per_s"] is None
    assert va.ratios({}, {"tokens_per_s": 2.0})["itl_p50_ms"] is None
    table = va.format_table(rows).splitlines()
    assert len(table) == 1 + 3 * len(rows) and "TTFT mean" in table[0] and "ITL p99" in table[0]
    assert table[1].split()[:4] == ["chat", "1", "vLLM", "128.0"]
    assert table[3].split()[:3] == ["dmtd/vLLM", "1.50", "2.00"]
    json.loads(json.dumps(rows))  # the --json payload's rows serialise as they are
    assert "—" in va.format_table(va.make_rows({"vllm": [{}], "dmtd": [OURS]}, plan[:1]))


def test_client_command_is_one_greedy_openai_chat_client(tmp_path):
    w = va.workloads([4], 3, 32, tmp_path / "d.jsonl", prefix=False)[0]
    cmd = va.client_command(tmp_path, "http://127.0.0.1:1", "m", "/tok", w, tmp_path / "r.json")
    s = " ".join(cmd)
    for part in ("bench serve", "--backend openai-chat", "--endpoint /v1/chat/completions", "--temperature 0",
                 "--max-concurrency 4", "--num-prompts 12", "--custom-output-len 32", "--skip-chat-template",
                 "--result-filename r.json"):
        assert part in s
    assert "--ignore-eos" not in s  # our OpenAI API has no ignore_eos: a request would be refused
    prefix = va.workloads([1], 1, 64, tmp_path / "d.jsonl")[-1]
    assert prefix["workload"] == "prefix" and prefix["concurrency"] == 4 and prefix["num_prompts"] == 32
    assert "--save-detailed" in s  # each request's TTFT: the cold prefixes' apart from the cached ones
    assert " ".join(prefix["dataset_args"]).endswith(
        "--prefix-repetition-prefix-len 1024 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 "
        "--prefix-repetition-output-len 64")
    ds = va.write_dataset(tmp_path / "d.jsonl")
    assert [json.loads(line)["prompt"] for line in ds.read_text().splitlines()] == list(va.CHAT_PROMPTS)


def test_vllm_serves_in_bf16_only_where_the_cpu_computes_in_bf16(tmp_path):
    from dmtd.engine.ops import cpu_flags

    assert va.vllm_dtype("auto", {"avx2", "fma", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert va.vllm_dtype("auto", {"avx2", "amx_bf16", "amx_tile"}) == "bfloat16"
    assert va.vllm_dtype("auto", {"avx2", "fma"}) == "float32"  # AVX2 only: vLLM's bf16 is emulated there
    assert va.vllm_dtype("auto", {"avx2", "avx512f"}) == "float32"  # AVX-512 without its bf16 extension
    assert va.vllm_dtype("bfloat16", {"avx2"}) == "bfloat16" and va.vllm_dtype("float32", {"amx_bf16"}) == "float32"
    assert va.vllm_dtype("auto") == va.vllm_dtype("auto", cpu_flags())  # this machine's own flags
    cmd = " ".join(va.serve_command(tmp_path, "/m", 1234, "smollm2", "float32"))
    assert cmd.endswith("serve /m --host 127.0.0.1 --port 1234 --dtype float32 --served-model-name smollm2")
    assert parse(["--against", "vllm"]).vllm_dtype == "auto"


def test_a_bad_vllm_dtype_exits_2_naming_the_option(capsys):
    from dmtd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--against", "vllm", "--vllm-dtype", "float16"])
    assert e.value.code == 2 and "--vllm-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # it sets vLLM's precision: without --against it would do nothing
        run_bench_serve(parse(["--vllm-dtype", "float32"]), "unused")
    assert e.value.code == 2 and "--vllm-dtype" in capsys.readouterr().err


def test_a_bad_against_value_exits_2_naming_the_option(capsys):
    from dmtd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--against", "tgi"])
    assert e.value.code == 2 and "--against" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--server", "127.0.0.1:9000"], "--server"), (["--dtypes", "auto,float32"], "--dtypes"),
    (["--compare-engine"], "--compare-engine"), (["--rate", "2"], "--rate"),
    (["--concurrency", "1,x"], "--concurrency"), (["--concurrency", "0"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens")])
def test_refused_combinations_exit_2_before_starting_anything(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--against", "vllm", *argv]), "unused")
    assert e.value.code == 2 and option in capsys.readouterr().err


def test_a_missing_vllm_venv_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--against", "vllm"]), "unused")
    assert e.value.code == 2 and "make bench-deps" in capsys.readouterr().err
