"""``dmtd bench serve --against vllm`` without vLLM: the rows, the best-of-configurations choice, ratios, table and JSON
from saved client results; the servers' and the client's command lines and environments; the two-turn dataset; and
the arguments a run refuses (exit code 2, naming the option)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dmtd.bench import vllm_anchor as va
from dmtd.bench import vllm_rows as vr
from dmtd.bench import vllm_workloads as vw
from dmtd.bench.exact_bench import CHATS
from dmtd.bench.serve_bench import add_bench_serve_args, run_bench_serve
from dmtd.serve.settings import engine_default

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


def test_rows_compare_ours_with_the_best_vllm_configuration(tmp_path):
    plan = vw.workloads([1, 16], 3, 64, tmp_path / "chats.jsonl")
    assert [(w["workload"], w["concurrency"], w["num_prompts"]) for w in plan] == [
        ("chat", 1, 8), ("chat", 16, 48), ("prefix", 4, 32), ("two-turn", 8, 32)]
    slow = {**VLLM, "output_throughput": 64.0, "mean_ttft_ms": 80.0}
    # bind is the faster configuration on the first three workloads, default on the last; ours runs after each
    ours_after_default = {**OURS, "output_throughput": 96.0}
    results = {"vllm": {"default": [slow, slow, slow, VLLM], "bind": [VLLM, VLLM, VLLM, slow]},
               "dmtd": {"default": [ours_after_default] * 4, "bind": [OURS] * 4}}
    rows = vr.make_rows(results, plan)
    assert [r["best"] for r in rows] == ["bind", "bind", "bind", "default"]
    r = rows[0]
    assert r["vllm"]["tokens_per_s"] == 128.0 and r["dmtd"]["tokens_per_s"] == 192.0  # ours beside the best
    assert r["vllm_configs"]["default"]["tokens_per_s"] == 64.0 and r["dmtd_runs"]["default"]["tokens_per_s"] == 96.0
    assert r["ratio"] == {"tokens_per_s": 1.5, "ttft_mean_ms": 2.0, "ttft_p50_ms": 2.0, "itl_p50_ms": 2.0,
                          "itl_p99_ms": 0.5, "tpot_p50_ms": 0.5}
    assert rows[3]["ratio"]["tokens_per_s"] == 96.0 / 128.0
    assert vr.ratios({"tokens_per_s": 1.0}, {"tokens_per_s": 0.0})["tokens_per_s"] is None
    assert vr.ratios({}, {"tokens_per_s": 2.0})["itl_p50_ms"] is None
    table = vr.format_table(rows).splitlines()
    assert len(table) == 1 + 4 * len(rows) and "TTFT mean" in table[0] and "ITL p99" in table[0]
    assert table[1].split()[:5] == ["chat", "1", "vLLM", "default", "64.0"]
    assert table[2].split()[:5] == ["chat", "1", "vLLM", "bind*", "128.0"]
    assert table[3].split()[:4] == ["chat", "1", "dmtd", "192.0"]
    assert table[4].split()[:3] == ["dmtd/best", "1.50", "2.00"]
    json.loads(json.dumps(rows))  # the --json payload's rows serialise as they are


def test_the_best_configuration_is_the_fastest_with_a_figure():
    assert vr.best_config({"default": {"tokens_per_s": 10.0}, "bind": {"tokens_per_s": 12.5}}) == "bind"
    assert vr.best_config({"default": {"tokens_per_s": 12.5}, "bind": {"tokens_per_s": 12.5}}) == "default"
    assert vr.best_config({"default": {"tokens_per_s": None}, "bind": {"tokens_per_s": 3.0}}) == "bind"
    assert vr.best_config({"default": {}, "bind": {"tokens_per_s": None}}) is None
    rows = vr.make_rows({"vllm": {"default": [{}]}, "dmtd": {"default": [OURS]}},
                        vw.workloads([1], 1, 8, Path("d.jsonl"), prefix=False, two_turn=False))
    assert rows[0]["best"] == "default" and "—" in vr.format_table(rows)


def test_a_two_turn_row_reports_the_second_turns_and_the_first_beside_them():
    raw = {**VLLM, "mean_ttft_ms": 30.0, "turn1": {**VLLM, "output_throughput": 100.0, "mean_ttft_ms": 70.0}}
    m = vr.side_metrics(raw)
    assert m["ttft_mean_ms"] == 30.0 and m["turn1_ttft_mean_ms"] == 70.0 and m["turn1_tokens_per_s"] == 100.0
    assert "turn1_tokens_per_s" not in vr.side_metrics(VLLM)


def test_client_command_is_one_greedy_openai_client(tmp_path):
    w = vw.workloads([4], 3, 32, tmp_path / "d.jsonl", prefix=False, two_turn=False)[0]
    cmd = vw.client_command(tmp_path, "http://127.0.0.1:1", "m", "/tok", w, tmp_path / "r.json")
    s = " ".join(cmd)
    for part in ("bench serve", "--backend openai-chat", "--endpoint /v1/chat/completions", "--temperature 0",
                 "--max-concurrency 4", "--num-prompts 12", "--custom-output-len 32", "--skip-chat-template",
                 "--result-filename r.json", "--num-warmups 1"):
        assert part in s
    assert "--ignore-eos" not in s  # our OpenAI API has no ignore_eos: a request would be refused
    assert "--save-detailed" in s  # each request's TTFT (the cold prefixes' apart from the cached ones) and text
    prefix = vw.workloads([1], 1, 64, tmp_path / "d.jsonl")[1]
    assert prefix["workload"] == "prefix" and prefix["concurrency"] == 4 and prefix["num_prompts"] == 32
    assert " ".join(prefix["dataset_args"]).endswith(
        "--prefix-repetition-prefix-len 1024 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 "
        "--prefix-repetition-output-len 64")
    ds = vw.write_dataset(tmp_path / "d.jsonl")
    assert [json.loads(line)["prompt"] for line in ds.read_text().splitlines()] == list(vw.CHAT_PROMPTS)
    assert list(vw.CHAT_PROMPTS) == CHATS
    # a two-turn turn: rendered prompts in the file's order to the completions endpoint, no warm-up for turn 2
    turn = {**vw.workloads([1], 1, 48, ds)[-1], "completions": True,
            "dataset_args": vw.turn_args(tmp_path / "t2.jsonl", 48)}
    s = " ".join(vw.client_command(tmp_path, "http://127.0.0.1:1", "m", "/tok", turn, tmp_path / "t.json",
                                   warmups=0))
    for part in ("--backend openai --", "--endpoint /v1/completions", "--disable-shuffle", "--skip-chat-template",
                 "--custom-output-len 48", "--max-concurrency 8", "--num-prompts 32", "--num-warmups 0"):
        assert part in s


def test_two_turn_conversations_carry_the_first_answer_in_the_second_turns_history(tmp_path):
    from dmtd.variants.loader import load_tokenizer
    from dmtd.variants.smollm2 import smollm2_dir

    firsts = vw.first_turns(32)
    assert len(set(firsts)) == 32 and firsts[:8] == CHATS  # the eight chats, then the validation chats
    render = vw.chat_template(str(smollm2_dir()))
    tok = load_tokenizer(smollm2_dir())  # the engine's own tokenizer, as our server applies the template
    answers = [f"Answer number {i}." for i in range(32)]
    one, two = vw.two_turn_prompts(firsts, None, render), vw.two_turn_prompts(firsts, answers, render)
    assert one[0] == tok.apply_chat_template([{"role": "user", "content": firsts[0]}], tokenize=False,
                                             add_generation_prompt=True)
    for i in range(32):
        # turn 2 begins with turn 1 as it was sent, then that conversation's own answer, then the follow-up
        first_prompt = one[i]
        generation_prompt = first_prompt[first_prompt.rindex(firsts[i]) + len(firsts[i]):]
        assert two[i].startswith(first_prompt + answers[i]) and two[i].endswith(generation_prompt)
        assert vw.FOLLOW_UPS[i % len(vw.FOLLOW_UPS)] in two[i][len(first_prompt):]
        assert firsts[i] in first_prompt and answers[(i + 1) % 32] not in two[i]
    first_ids = tok(one[5]).input_ids
    assert tok(two[5]).input_ids[:len(first_ids)] == first_ids  # turn 1's tokens are turn 2's prefix
    with pytest.raises(ValueError, match="31 first answers for 32"):
        vw.two_turn_prompts(firsts, answers[:31], render)
    path = vw.write_prompts(tmp_path / "t.jsonl", two)
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == two


def test_vllm_runs_with_its_defaults_and_with_every_core_bound(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")  # the caller's own setting does not leak into either
    default, bind = va.vllm_env("default"), va.vllm_env("bind", {0, 1})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default and bind["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    for env in (default, bind):
        assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_CPU_KVCACHE_SPACE"] == va.KVCACHE_GIB
    import os

    assert va.vllm_env("bind")["VLLM_CPU_OMP_THREADS_BIND"] == va.cpu_list(os.sched_getaffinity(0))
    assert va.cpu_list({0, 1}) == "0-1" and va.cpu_list([5, 0, 1, 2]) == "0-2,5" and va.cpu_list({3}) == "3"
    assert parse(["--against", "vllm"]).vllm_configs == "default,bind"
    assert va.check_args(parse(["--against", "vllm", "--vllm-configs", "bind"])) == ([1, 4, 16], ["bind"])


def test_vllm_serves_in_bf16_only_where_the_cpu_computes_in_bf16(tmp_path):
    from dmtd.engine.ops import cpu_flags

    assert va.vllm_dtype("auto", {"avx2", "fma", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert va.vllm_dtype("auto", {"avx2", "amx_bf16", "amx_tile"}) == "bfloat16"
    assert va.vllm_dtype("auto", {"avx2", "fma"}) == "float32"  # AVX2 only: vLLM's bf16 is emulated there
    assert va.vllm_dtype("auto", {"avx2", "avx512f"}) == "float32"  # AVX-512 without its bf16 extension
    assert va.vllm_dtype("bfloat16", {"avx2"}) == "bfloat16" and va.vllm_dtype("float32", {"amx_bf16"}) == "float32"
    assert va.vllm_dtype("auto") == va.vllm_dtype("auto", cpu_flags())  # this machine's own flags
    cmd = " ".join(va.serve_command(tmp_path, "/m", 1234, "smollm2", "float32"))
    assert cmd.endswith("serve /m --host 127.0.0.1 --port 1234 --dtype float32 --served-model-name smollm2 "
                        f"--max-model-len {engine_default('max_model_len')}")
    # a shape without weights (dmtd shapes export) runs on both sides with vLLM's own spelling of the option
    dummy = va.serve_command(tmp_path, "/m", 1234, "smollm2", "bfloat16", "dummy")
    assert dummy[-2:] == ["--load-format", "dummy"]
    assert parse(["--against", "vllm"]).vllm_dtype == "auto"


def test_a_bad_vllm_dtype_exits_2_naming_the_option(capsys):
    from dmtd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--against", "vllm", "--vllm-dtype", "float16"])
    assert e.value.code == 2 and "--vllm-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # it sets vLLM's precision: without --against it would do nothing
        run_bench_serve(parse(["--vllm-dtype", "float32"]), "unused")
    assert e.value.code == 2 and "--vllm-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--vllm-configs", "bind"]), "unused")
    assert e.value.code == 2 and "--vllm-configs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--one-server-at-a-time"]), "unused")
    assert e.value.code == 2 and "--one-server-at-a-time" in capsys.readouterr().err


def test_a_bad_against_value_exits_2_naming_the_option(capsys):
    from dmtd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--against", "tgi"])
    assert e.value.code == 2 and "--against" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--server", "127.0.0.1:9000"], "--server"), (["--dtypes", "auto,float32"], "--dtypes"),
    (["--compare-engine"], "--compare-engine"), (["--rate", "2"], "--rate"),
    (["--concurrency", "1,x"], "--concurrency"), (["--concurrency", "0"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--vllm-configs", "fast"], "--vllm-configs"),
    (["--vllm-configs", "bind,bind"], "--vllm-configs"), (["--vllm-configs", ","], "--vllm-configs"),
    (["--load-format", "dummy"], "--load-format"), (["--vllm-workloads", "chat,bogus"], "--vllm-workloads"),
    (["--vllm-workloads", ","], "--vllm-workloads")])
def test_refused_combinations_exit_2_before_starting_anything(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--against", "vllm", *argv]), "unused")
    assert e.value.code == 2 and option in capsys.readouterr().err


def test_a_missing_vllm_venv_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(SystemExit) as e:
        run_bench_serve(parse(["--against", "vllm"]), "unused")
    assert e.value.code == 2 and "make bench-deps" in capsys.readouterr().err
