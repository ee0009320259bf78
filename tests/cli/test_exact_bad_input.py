"""The exact profile's numeric inputs on the commands that take them: refused with exit code 2, naming the
flag, before any model loads or any benchmark runs."""

from __future__ import annotations

import pytest

from dmtd.cli import main


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan"])
def test_bench_engine_refuses_a_draft_threshold_out_of_range(value, capsys):
    assert main(["bench", "engine", "--draft-threshold", value, "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr()
    assert f"--draft-threshold: must be in [0, 1], got {float(value)}" in err.err
    assert "measuring" not in err.out  # refused before the bandwidth measurement starts


def test_bench_engine_on_a_gpu_refuses_the_cpu_only_rows(capsys):
    """HF generate and llama.cpp rows run on the CPU: --device cuda with them is refused before any load."""
    assert main(["bench", "engine", "--device", "cuda", "--model", "/nonexistent/model"]) == 2
    assert "--device: cuda: the HF and llama.cpp rows run on the CPU only" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--taus", "0,2"), ("--rounds", "0"), ("--max-new-tokens", "0")])
def test_bench_passes_names_the_flag_below_one(flag, value, capsys):
    assert main(["bench", "passes", flag, value]) == 2
    assert f"{flag}: must be at least 1" in capsys.readouterr().err
