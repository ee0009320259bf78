"""``dmtd phrase-table``: the next token the corpora's answers put after 3-token contexts, written into a variant."""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dmtd.engine.phrase_table import LONG_HIGH, LONG_LOW, SHORT
from dmtd.train.corpus import Record, load_corpus
from dmtd.train.phrase_table import ALL, build, evaluate, run_phrase_table
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.manifest import ManifestError, read_manifest
from tests.train.test_draft_vocab import variant_over


def rec(prompt: list[int], answer: list[int]) -> Record:
    return Record(0, 0, "train", 0.0, 0, prompt, answer, "stop")


def test_the_table_keeps_a_contexts_most_frequent_token_where_it_was_seen_enough():
    records = [rec([9, 1, 2], [3, 4]), rec([1, 2], [3, 5]), rec([8, 1, 2], [3, 4, 6]), rec([7], [1, 2, 3, 4])]
    table = build(records, 97, min_count=1, min_share=0.0)
    assert table.entries[table.key([1, 2, 3])] == (4, 75)  # 4 three times of four; the prompt leads into the answer
    assert table.entries[table.key([9, 1, 2])] == (3, 100)
    tie = build([rec([], [1, 2, 3, 6]), rec([], [1, 2, 3, 5])], 97, 1, 0.0)
    assert tie.entries[tie.key([1, 2, 3])] == (5, 50)  # a tie goes to the lower id
    strict = build(records, 97, min_count=4, min_share=0.75)
    assert list(strict.entries) == [strict.key([1, 2, 3])]  # the only context seen 4 times
    assert build(records, 97, min_count=4, min_share=0.8).entries == {}
    assert table.short[table.key([2, 3])] == (4, 75) and table.short[table.key([1, 2])] == (3, 100)
    # by source, (named, right): 9 1 2 → 3 (right, 100 %), 1 2 3 → 4 (not 5; 75 %), 2 3 5 and 3 5: not there
    assert evaluate(table, [rec([9, 1, 2], [3, 5, 6])]) == {ALL: (3, 0), LONG_HIGH: (1, 1), LONG_LOW: (1, 0),
                                                            SHORT: (0, 0)}
    assert evaluate(table, [rec([6, 1, 2], [3])])[SHORT] == (1, 1)  # 6 1 2: not there, 1 2 → 3 is


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(min_count=1, min_share=0.5, write=True), **kw})


def test_the_written_table_loads_into_the_engine_and_a_tampered_one_is_refused(tiny_dir, tiny_corpus_dir, tmp_path,
                                                                              capsys):
    root = variant_over(tiny_dir, tmp_path / "v")
    assert run_phrase_table(args(corpus=[tiny_corpus_dir], variant=root)) == 0
    out = capsys.readouterr().out
    assert "held-out greedy answers the table names the next token at" in out
    m = read_manifest(root)
    assert m.phrase_table == "phrase_table.safetensors" and m.phrase_table_sha256
    records = load_corpus(tiny_corpus_dir).split("train")
    expect = build(records, 97, 1, 0.5)
    spec = engine_spec(None, str(root))
    assert spec.phrase_table is not None and spec.phrase_table.entries == expect.entries and len(expect) > 0
    assert spec.phrase_table.short == expect.short and expect.short
    assert build_engine(spec).phrase_table is spec.phrase_table
    assert {p for _, p in [*expect.entries.values(), *expect.short.values()]} <= set(range(50, 101))
    path = root / "phrase_table.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}  # not the mapped file: it is rewritten
    assert tensors["keys"].tolist() == sorted(tensors["keys"].tolist())
    path.write_bytes(b"garbage")
    with pytest.raises(ManifestError, match="phrase_table checksum mismatch"):
        engine_spec(None, str(root))
    no_format = dict(tensors)
    for content in (b"garbage", None):  # with the right hash: no safetensors file; one without the table's format
        if content is None:
            save_file(no_format, str(path))
        else:
            path.write_bytes(content)
        data = json.loads((root / "variant.json").read_text())
        data["phrase_table_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (root / "variant.json").write_text(json.dumps(data))
        with pytest.raises(ManifestError, match="is not a dmtd-phrase-table-v1 file"):
            engine_spec(None, str(root))


@pytest.mark.parametrize("tensor,value,rule", [("next", 97, "next must hold values in 0..96"),
                                               ("keys2", -1, "keys2 must hold values in 0..9408"),
                                               ("share", 101, "share must hold values in 0..100"),
                                               ("keys", "twice", "keys must not hold a context twice"),
                                               ("next2", "2d", "next2 must be a 1-D torch.int32 tensor")])
def test_a_table_with_the_right_hash_and_wrong_contents_is_refused_naming_the_tensor(tiny_dir, tiny_corpus_dir,
                                                                                     tmp_path, tensor, value, rule):
    root = variant_over(tiny_dir, tmp_path / "v")
    run_phrase_table(args(corpus=[tiny_corpus_dir], variant=root))
    path = root / "phrase_table.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    x = tensors[tensor]
    if value == "twice":
        tensors[tensor] = torch.cat([x, x[:1]])
        for k in ("next", "share"):
            tensors[k] = torch.cat([tensors[k], tensors[k][:1]])
    elif value == "2d":
        tensors[tensor] = x[None]
    else:
        x[0] = value
    save_file(tensors, str(path), metadata=meta)
    data = json.loads((root / "variant.json").read_text())
    data["phrase_table_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (root / "variant.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=re.escape(rule)):
        engine_spec(None, str(root))


def test_a_mirror_of_xz_shards_is_a_corpus_too(tiny_corpus_dir, tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copy(tiny_corpus_dir / "corpus.json", mirror)
    for f in tiny_corpus_dir.glob("shard-*.jsonl"):
        (mirror / (f.name + ".xz")).write_bytes(lzma.compress(f.read_bytes()))
    assert load_corpus(mirror).records == load_corpus(tiny_corpus_dir).records
    first = sorted(mirror.glob("*.xz"))[0]
    first.write_bytes(lzma.compress(b"{}\n"))
    with pytest.raises(Exception, match="corrupted"):
        load_corpus(mirror)


def test_the_cli_refuses_bad_thresholds_before_any_work(tiny_dir, tmp_path, capsys):
    from dmtd.cli import main

    root = variant_over(tiny_dir, tmp_path / "v")
    common = ["phrase-table", "--corpus", str(tmp_path / "no-corpus"), "--variant", str(root), "--write"]
    for bad, words in ([["--min-count", "0"], "--min-count: must be >= 1, got 0"],
                       [["--min-share", "1.5"], "--min-share: must be in (0, 1], got 1.5"],
                       [["--min-share", "0"], "--min-share: must be in (0, 1], got 0.0"]):
        assert main([*common, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
    assert main(common) == 2  # the corpus does not exist: named, nothing written
    assert "no-corpus" in capsys.readouterr().err
    assert read_manifest(root).phrase_table is None and not (root / "phrase_table.safetensors").exists()
