"""``dmtd serve``'s flags become the Serve app's typed config: its defaults are the config's, a bad value is a usage
error (exit 2, the field and its rule named) before anything starts, and ``--no-phrase-drafts`` reaches the config."""

from __future__ import annotations

import argparse

import pytest

from dmtd.cli import EXIT_USAGE, main
from dmtd.serve.local import add_serve_args, serve_args
from dmtd.serve.settings import EngineSettings


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_the_flags_defaults_are_the_configs(monkeypatch) -> None:
    for var in ("DMTD_STREAM_INTERVAL_MS", "DMTD_BLOCK_PUSH"):
        monkeypatch.delenv(var, raising=False)
    cfg = serve_args(parse(), "none")
    engine = cfg.engine(cfg.variants[0])
    assert engine == EngineSettings()  # every engine setting at the one default
    assert (cfg.variants[0].name, cfg.grpc_port, cfg.routing, cfg.stream_interval_ms) == ("base", 9000, "prefix", 40.0)


def test_flags_reach_the_config() -> None:
    cfg = serve_args(parse("--max-num-seqs", "8", "--no-phrase-drafts", "--drafts", "fixed", "--max-queued", "3",
                           "--decoding-layers", "8"), "none")
    engine = cfg.engine(cfg.variants[0])
    assert (engine.max_num_seqs, engine.phrase_drafts, engine.context_drafts, engine.drafts, engine.max_queued) == (
        8, False, True, "fixed", 3)
    assert cfg.variants[0].name == "base-d8" and cfg.variants[0].decoding_layers == 8


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-num-seqs", "0"], "max_num_seqs: input should be greater than or equal to 1, got 0"),
    (["--stream-interval-ms", "5000"], "stream_interval_ms: input should be less than or equal to 1000"),
    (["--block-push", "somewhere"], "block_push: must be 'auto', 'off' or an IP address"),
])
def test_a_bad_value_exits_2_naming_the_field_before_anything_starts(flags, message, capsys) -> None:
    assert main(["serve", "--variant", "none", *flags]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
