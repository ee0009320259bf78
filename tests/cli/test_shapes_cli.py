"""``dmtd shapes`` and ``--load-format dummy`` on the command line: the presets listed, a folder exported, a shape run
by ``dmtd generate`` from it, and bad input (an unknown preset, a folder in the way, a shape too large for memory) an
error naming it with exit code 2; ``dmtd serve --load-format dummy`` reaches its replicas' engine builder."""

from __future__ import annotations

import json

from dmtd.cli import EXIT_USAGE, build_parser, main
from dmtd.variants.shapes import preset_names
from tests.variants.test_shapes import tiny_shape


def test_shapes_list_names_every_preset_with_its_parameters(capsys) -> None:
    assert main(["shapes", "list"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert name in out
    assert "1.24B" in out and "8.03B" in out  # Llama-3.2-1B, Llama-3.1-8B


def test_an_exported_folder_runs_with_dmtd_generate_and_the_same_seed_writes_the_same_tokens(tmp_path, capsys):
    from dmtd.variants.shapes import export_shape

    d = export_shape(tiny_shape("qwen3"), tmp_path / "tiny")
    argv = ["generate", "--model", str(d), "--load-format", "dummy", "--variant", "none", "--prompt", "Hello",
            "--max-new-tokens", "5", "--json", "--dtype", "float32"]
    records = []
    for _ in range(2):
        assert main(argv) == 0
        records.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert len(records[0]["token_ids"]) == 5 and records[0]["token_ids"] == records[1]["token_ids"]
    auto = [("auto" if a == "dummy" else a) for a in argv]
    assert main(auto) == EXIT_USAGE  # without dummy: the folder's weights are missing
    assert "--load-format dummy" in capsys.readouterr().err


def test_bad_shapes_input_exits_2_naming_it(tmp_path, capsys) -> None:
    assert main(["shapes", "export", "llama-9000b", str(tmp_path / "x")]) == EXIT_USAGE
    assert "llama-9000b" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["shapes", "export", "qwen3-4b", str(busy)]) == EXIT_USAGE
    assert "not a shape folder" in capsys.readouterr().err and (busy / "notes.txt").read_text() == "mine"
    huge = tiny_shape("llama")
    huge.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=400, num_attention_heads=512,
                num_key_value_heads=64, head_dim=128)
    (tmp_path / "config.json").write_text(json.dumps(huge))
    assert main(["generate", "--model", str(tmp_path), "--load-format", "dummy", "--variant", "none",
                 "--prompt", "Hi"]) == EXIT_USAGE
    assert "the model's weights need" in capsys.readouterr().err


def test_serve_load_format_reaches_the_replicas_engine_builder(tmp_path, monkeypatch) -> None:
    from dmtd.serve.engine_builder import EngineBuilder
    from dmtd.variants.loader import LOAD_FORMAT_ENV
    from dmtd.variants.shapes import export_shape
    from dmtd_contract.serve_config import EngineSettings

    assert build_parser().parse_args(["serve", "--load-format", "dummy"]).load_format == "dummy"
    d = export_shape(tiny_shape("llama"), tmp_path / "tiny")
    monkeypatch.setenv(LOAD_FORMAT_ENV, "dummy")  # what dmtd serve --load-format dummy sets for its replicas
    engine, _ = EngineBuilder(model=str(d), torch_threads=1,
                              settings=EngineSettings(dtype="float32", max_num_seqs=1, max_model_len=64))()
    assert engine.runner.model.config.num_layers == 4


def test_bench_engine_with_dummy_weights_refuses_the_rows_that_read_the_weights(capsys) -> None:
    assert main(["bench", "engine", "--load-format", "dummy", "--model", "/nonexistent/model"]) == EXIT_USAGE
    err = capsys.readouterr()
    assert "--load-format: dummy: the HF and llama.cpp rows read the model's own weights" in err.err
    assert "measuring" not in err.out  # before any measurement or load
