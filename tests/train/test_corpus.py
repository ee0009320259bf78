"""Corpus generation: deterministic, resumable, hashed, split by prompt; the built-in prompt set."""

from __future__ import annotations

import json
import lzma
import shutil
from collections import Counter
from pathlib import Path

import pytest

from dmtd.engine.config import DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.train.corpus import CorpusError, load_corpus, plan_records, read_manifest
from dmtd.train.datagen import load_user_prompts, make_corpus
from dmtd.train.prompts import builtin_prompts
from dmtd.variants.loader import load_model
from tests.train.helpers import corpus_config, tiny_corpus, tiny_prompts


def test_same_config_same_bytes_and_hash(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    again = tiny_corpus(tiny_dir, tmp_path / "again")
    first = read_manifest(tiny_corpus_dir)
    assert again.content_hash == first.content_hash and again.complete
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards]
    corpus = load_corpus(tiny_corpus_dir)
    assert len(corpus.records) == 24 and corpus.manifest.num_tokens == sum(r.num_tokens for r in corpus.records)
    # greedy and sampled completions, the first sample of each prompt greedy
    assert {r.temperature for r in corpus.records} == {0.0, 1.0}
    assert all(len(r.completion_ids) == 20 for r in corpus.records)


def test_interrupted_generation_resumes_to_the_same_corpus(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    loaded = load_model(tiny_dir, tokenizer=False)
    engine = LLMEngine(loaded.model, None, DMTDConfig.plain(6, 1), EngineConfig(max_num_seqs=4, max_model_len=128),
                       default_tau=1, eos_token_ids=[])
    prompts = tiny_prompts(12)
    cfg = corpus_config(tiny_dir, prompts)

    def die(k: int) -> None:
        if k == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_corpus(tmp_path / "c", engine, prompts, cfg, progress=False, on_shard=die)
    partial = read_manifest(tmp_path / "c")
    assert len(partial.shards) == 2 and not partial.complete
    assert len(load_corpus(tmp_path / "c").records) == 12  # a finished prefix is usable
    with pytest.raises(CorpusError, match="incomplete"):
        load_corpus(tmp_path / "c", require_complete=True)
    done = make_corpus(tmp_path / "c", engine, prompts, cfg, progress=False)
    assert done.content_hash == read_manifest(tiny_corpus_dir).content_hash
    with pytest.raises(CorpusError, match="different config.*max_new_tokens"):
        make_corpus(tmp_path / "c", engine, prompts, corpus_config(tiny_dir, prompts, max_new_tokens=9),
                    progress=False)


def test_limit_grows_the_same_corpus(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    small = tiny_corpus(tiny_dir, tmp_path / "c", limit=7)  # rounds up to whole shards of 6
    assert sum(s.num_records for s in small.shards) == 12
    grown = tiny_corpus(tiny_dir, tmp_path / "c")
    assert grown.content_hash == read_manifest(tiny_corpus_dir).content_hash


def test_held_out_split_is_by_prompt(tiny_dir: Path):
    cfg = corpus_config(tiny_dir, tiny_prompts(200), samples_per_prompt=3, held_out_fraction=0.1)
    plan = plan_records(cfg)
    splits: dict[int, set[str]] = {}
    for r in plan:
        splits.setdefault(r.prompt_idx, set()).add(r.split)
    assert all(len(s) == 1 for s in splits.values())
    held = sum("heldout" in s for s in splits.values())
    assert 8 <= held <= 35
    assert sorted(r.idx for r in plan) == list(range(600))
    assert Counter(r.temperature for r in plan) == {0.0: 200, 1.0: 400}


def test_corrupted_or_missing_corpus_is_refused(tiny_corpus_dir: Path, tmp_path: Path):
    import shutil

    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "nope")
    bad = tmp_path / "bad"
    shutil.copytree(tiny_corpus_dir, bad)
    shard = bad / "shard-00001.jsonl"
    shard.write_bytes(shard.read_bytes().replace(b'"idx":', b'"idx" :', 1))
    with pytest.raises(CorpusError, match="shard-00001.jsonl is corrupted"):
        load_corpus(bad)
    (bad / "corpus.json").write_text("{not json")
    with pytest.raises(CorpusError, match="corrupted corpus manifest"):
        load_corpus(bad)
    with pytest.raises(CorpusError, match="outside the base model's vocabulary"):
        load_corpus(tiny_corpus_dir, vocab_size=10)


def test_builtin_prompts_are_many_varied_and_stable():
    p = builtin_prompts()
    assert len(p) >= 900 and len(set(p)) == len(p)
    assert p == builtin_prompts()
    starts = Counter(x.split()[0] for x in p)
    assert {"Write", "What", "Explain", "List", "Give"} <= set(starts)
    assert any("def " in x for x in p) and any(x.endswith("?") for x in p)


def test_user_prompt_files(tmp_path: Path):
    (tmp_path / "p.txt").write_text("first\n\nsecond line\n")
    assert load_user_prompts(tmp_path / "p.txt") == ["first", "second line"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert load_user_prompts(tmp_path / "p.jsonl") == ["a", [{"role": "user", "content": "b"}]]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(CorpusError, match="bad.jsonl:1"):
        load_user_prompts(tmp_path / "bad.jsonl")


def test_wide_prompts_are_thousands_varied_stable_and_start_with_v1():
    from dmtd.train.prompts_wide import wide_prompts

    p = wide_prompts()
    v1 = builtin_prompts()
    assert len(p) >= 4000 and p[: len(v1)] == v1 and p == wide_prompts()
    keys = [x if isinstance(x, str) else json.dumps(x) for x in p]
    assert len(set(keys)) == len(keys)
    convs = [x for x in p if isinstance(x, list)]
    assert len(convs) >= 300 and all(m["role"] in ("system", "user", "assistant") and m["content"] for c in convs
                                     for m in c)
    assert any(len(c) == 3 and c[1]["role"] == "assistant" for c in convs)  # multi-turn
    assert any(c[0]["role"] == "system" for c in convs)  # personas
    text = [x for x in p if isinstance(x, str)]
    for needle in ("essay of about 400 words", "step-by-step guide", "Write a Rust function", "SQL query",
                   "unit tests", "Find and fix the bug", "numbered list", "Solve for x"):
        assert any(needle in x for x in text), needle


def test_a_mirror_rebuilds_the_corpus_without_generating_and_refuses_a_bad_shard(tiny_dir: Path,
                                                                                tiny_corpus_dir: Path,
                                                                                tmp_path: Path):
    loaded = load_model(tiny_dir, tokenizer=False)
    engine = LLMEngine(loaded.model, None, DMTDConfig.plain(6, 1), EngineConfig(max_num_seqs=4, max_model_len=128),
                       default_tau=1, eos_token_ids=[])
    prompts = tiny_prompts(12)
    cfg = corpus_config(tiny_dir, prompts)
    mirror = tmp_path / "mirror"
    first = read_manifest(tiny_corpus_dir)
    # a corpus made before it had a mirror: its shards go into the mirror when the command names one
    shutil.copytree(tiny_corpus_dir, tmp_path / "made")
    make_corpus(tmp_path / "made", engine, prompts, cfg, progress=False, mirror=mirror)
    assert sorted(p.name for p in mirror.iterdir()) == ["corpus.json"] + [s.name + ".xz" for s in first.shards]
    assert sum(p.stat().st_size for p in mirror.glob("*.xz")) < sum(
        (tiny_corpus_dir / s.name).stat().st_size for s in first.shards)

    calls = []
    real = engine.generate
    engine.generate = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[method-assign]
    rebuilt = make_corpus(tmp_path / "new", engine, prompts, cfg, progress=False, mirror=mirror)
    assert rebuilt.content_hash == first.content_hash and calls == []
    for s in first.shards:
        assert (tmp_path / "new" / s.name).read_bytes() == (tiny_corpus_dir / s.name).read_bytes()

    bad = mirror / (first.shards[1].name + ".xz")
    bad.write_bytes(lzma.compress(b'{"idx": 0}\n'))
    with pytest.raises(CorpusError, match="does not match its SHA-256"):
        make_corpus(tmp_path / "again", engine, prompts, cfg, progress=False, mirror=mirror)
    with pytest.raises(CorpusError, match="different config.*max_new_tokens"):
        make_corpus(tmp_path / "other", engine, prompts, corpus_config(tiny_dir, prompts, max_new_tokens=9),
                    progress=False, mirror=mirror)
