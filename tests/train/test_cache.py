"""The teacher cache: the cached step equals the uncached one, resumes exactly, and refuses stale or corrupt data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dmtd.train.cache import CacheError, CacheSpec, teacher_targets
from dmtd.train.checkpoint import CheckpointError
from dmtd.train.corpus import CorpusError
from dmtd.train.metrics import TopKTargets, topk_kl
from dmtd.train.trainer import Trainer
from tests.train.helpers import save_tiny, tiny_cache, tiny_corpus, train_config
from tests.train.test_e2e_cli import dmtd


@pytest.fixture(scope="module")
def exact_cache(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tiny_dir, tiny_corpus_dir, out=tmp_path_factory.mktemp("cache") / "exact")


def test_topk_kl_is_the_full_kl_at_k_vocab_and_a_lower_bound_below():
    g = torch.Generator().manual_seed(0)
    zt, zs = torch.randn(5, 50, generator=g) * 3, torch.randn(5, 50, generator=g) * 3
    lt, ls = F.log_softmax(zt, -1), F.log_softmax(zs, -1)
    full = (lt.exp() * (lt - ls)).sum(-1)
    assert torch.allclose(topk_kl(ls, TopKTargets(*teacher_targets(zt, 50))), full, atol=1e-5)
    for k in (1, 8, 49):
        coarse = topk_kl(ls, TopKTargets(*teacher_targets(zt, k)))
        assert bool((coarse >= -1e-6).all()) and bool((coarse <= full + 1e-5).all())  # coarse-graining
    ids, logp, rest = teacher_targets(zt, 8)
    assert torch.allclose(logp.exp().sum(-1) + rest.exp(), torch.ones(5), atol=1e-5)
    assert torch.equal(ids[:, 0].long(), zt.argmax(-1))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_cached_steps_equal_uncached_steps(grad_accum: int, tiny_dir: Path, tiny_corpus_dir: Path,
                                           exact_cache: Path, tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, grad_accum=grad_accum, ce_weight=0.5, tail_weight=2.0)
    unc = Trainer(cfg, tmp_path / "u", progress=False)
    cac = Trainer(cfg.model_copy(update={"cache": str(exact_cache)}), tmp_path / "c", progress=False)
    for step in range(3):
        a, b = unc.train_step(step), cac.train_step(step)
        for key in ("loss", "kl", "ce", "grad_norm", "tail_agree", "tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    for name, p in unc.params.items():
        assert torch.allclose(p, cac.params[name], atol=1e-4), name


def test_default_cache_trains_close_to_the_uncached_run(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    cache = tiny_cache(tiny_dir, tiny_corpus_dir, top_k=64, hidden_dtype="bfloat16", out=tmp_path / "k64")
    assert CacheSpec(0, 2, 64, "bfloat16").dirname == "cache-e0-d2-k64-bfloat16"
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=6)
    unc, cac = Trainer(cfg, tmp_path / "u", progress=False), Trainer(
        cfg.model_copy(update={"cache": str(cache)}), tmp_path / "c", progress=False)
    start = {n: p.detach().clone() for n, p in unc.params.items()}
    unc.run()
    cac.run()
    moved = sum(float((unc.params[n] - start[n]).detach().norm() ** 2) for n in start) ** 0.5
    apart = sum(float((unc.params[n] - cac.params[n]).detach().norm() ** 2) for n in start) ** 0.5
    # top-64 of 97 ids (98% of the teacher's mass here) and bf16 states: the same run, closely (measured 4%)
    assert moved > 0 and apart < 0.1 * moved
    assert unc.state.last["kl"] == pytest.approx(cac.state.last["kl"], rel=0.1)


def test_cached_run_resumes_exactly_and_refuses_another_cache(tiny_dir: Path, tiny_corpus_dir: Path,
                                                              exact_cache: Path, tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=5, cache=str(exact_cache))
    whole = Trainer(cfg, tmp_path / "whole", progress=False)
    whole.run()
    Trainer(cfg, tmp_path / "split", progress=False).run(stop_at=2)
    second = Trainer(cfg, tmp_path / "split", progress=False)
    assert second.state.step == 2
    second.run()
    for name, p in whole.params.items():
        assert torch.equal(p, second.params[name]), name
    other = tiny_cache(tiny_dir, tiny_corpus_dir, top_k=8, out=tmp_path / "other")
    moved = shutil.copytree(exact_cache, tmp_path / "moved")  # a cache may move: its content is what counts
    assert Trainer(cfg.model_copy(update={"cache": str(moved)}), tmp_path / "split", progress=False).state.step == 5
    for cache in (str(other), None):
        with pytest.raises(CheckpointError, match="another teacher cache \\(or without one\\)"):
            Trainer(cfg.model_copy(update={"cache": cache}), tmp_path / "split", progress=False)


def test_greedy_only_cache_serves_a_run_on_the_greedy_records(tiny_dir: Path, tiny_corpus_dir: Path,
                                                                exact_cache: Path, tmp_path: Path):
    greedy = tiny_cache(tiny_dir, tiny_corpus_dir, out=tmp_path / CacheSpec(0, 2, 97, "float32", (0.0,)).dirname,
                        temperatures=(0.0,))
    assert greedy.name == "cache-e0-d2-k97-float32-t0"
    metas = [json.loads(p.read_text()) for p in sorted(greedy.glob("shard-*.json"))]
    full = [json.loads(p.read_text()) for p in sorted(exact_cache.glob("shard-*.json"))]
    cfg = train_config(tiny_dir, tiny_corpus_dir, temperatures=[0.0], ce_weight=0.5)
    unc = Trainer(cfg, tmp_path / "u", progress=False)
    greedy_records = sum(r.temperature == 0.0 for r in unc.corpus.records)  # the corpus samples at 0 and 1
    assert 0 < sum(m["num_records"] for m in metas) == greedy_records < sum(m["num_records"] for m in full)
    cac = Trainer(cfg.model_copy(update={"cache": str(greedy)}), tmp_path / "c", progress=False)
    assert unc.train_records and {r.temperature for r in unc.train_records} == {0.0}
    assert len(unc.train_records) < len(unc.corpus.split("train"))
    for step in range(2):  # the same greedy batches, cached or not
        a, b = unc.train_step(step), cac.train_step(step)
        for key in ("loss", "kl", "ce", "tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    with pytest.raises(CacheError, match="holds only the records sampled at temperatures \\[0.0\\]; train with "
                       "--temperatures 0"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, cache=str(greedy)), tmp_path / "all", progress=False)
    with pytest.raises(CacheError, match="cache-e0-d2-k64-bfloat16-t0' is not a teacher cache"):  # 'auto'
        Trainer(train_config(tiny_dir, tiny_corpus_dir, temperatures=[0.0], cache="auto"), tmp_path / "a",
                progress=False)
    with pytest.raises(CorpusError, match="no training records at temperatures \\[0.5\\]"):
        Trainer(train_config(tiny_dir, tiny_corpus_dir, temperatures=[0.5]), tmp_path / "none", progress=False)
    with pytest.raises(CacheError, match="at least one temperature"):
        CacheSpec(0, 2, temperatures=())


def test_building_resumes_per_shard(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    copy = tiny_cache(tiny_dir, tiny_corpus_dir, out=tmp_path / "cache")
    before = {p.name: p.read_bytes() for p in copy.glob("*.npy")}
    (copy / "shard-00001.json").unlink()
    (copy / "shard-00001.hidden.npy").unlink()
    tiny_cache(tiny_dir, tiny_corpus_dir, out=copy)
    assert {p.name: p.read_bytes() for p in copy.glob("*.npy")} == before


def test_stale_corrupt_or_mismatched_cache_fails_before_any_step(tiny_dir: Path, tiny_corpus_dir: Path,
                                                                  exact_cache: Path, tmp_path: Path):
    def trainer(cache: Path, corpus: Path = tiny_corpus_dir, model: Path = tiny_dir, **kw: object) -> Trainer:
        return Trainer(train_config(model, corpus, cache=str(cache), **kw), tmp_path / "run", progress=False)

    bad = shutil.copytree(exact_cache, tmp_path / "bad")
    f = bad / "shard-00001.topk_logp.npy"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="topk_logp.npy is corrupted"):
        trainer(bad)
    (bad / "shard-00001.json").unlink()
    with pytest.raises(CacheError, match="lacks corpus shard shard-00001"):
        trainer(bad)
    grown = tiny_corpus(tiny_dir, tmp_path / "grown", seed=3)  # other shard bytes under the same names
    assert grown.shards[0].sha256 != json.loads((exact_cache / "shard-00000.json").read_text())["corpus_sha256"]
    with pytest.raises(CacheError, match="stale"):
        trainer(exact_cache, corpus=tmp_path / "grown")
    with pytest.raises(CacheError, match="E = 0, D = 2; this run has E = 0, D = 3"):
        trainer(exact_cache, num_decoding_layers=3)
    with pytest.raises(CacheError, match="not a teacher cache"):
        trainer(tmp_path / "nothing")
    other = save_tiny(tmp_path / "other", seed=1)
    with pytest.raises(CacheError, match="another base model"):
        tiny_cache(other, tiny_corpus_dir, out=tmp_path / "o")  # the corpus is not the other model's either
    with pytest.raises(ValueError, match="cache needs scope 'decoding'"):
        train_config(tiny_dir, tiny_corpus_dir, cache=str(exact_cache), scope="all")


def test_cli_cache_bench_and_curve(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    corpus = shutil.copytree(tiny_corpus_dir, tmp_path / "corpus")
    r = dmtd("cache", "--corpus", str(corpus), "--model", str(tiny_dir), "--num-decoding-layers", "2",
             "--top-k", "97", "--hidden-dtype", "float32", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert (corpus / "cache-e0-d2-k97-float32" / "shard-00000.json").is_file()
    r = dmtd("cache", "--corpus", str(corpus), "--model", str(tiny_dir), "--top-k", "0")
    assert r.returncode == 2 and "top_k must be >= 1" in r.stderr
    common = ["--corpus", str(corpus), "--base-model", str(tiny_dir), "--num-decoding-layers", "2",
              "--batch-size", "3", "--max-len", "64", "--threads", "1"]
    out = tmp_path / "bench.json"
    r = dmtd("train", "--run-dir", str(tmp_path / "b"), *common, "--cache", str(corpus / "cache-e0-d2-k97-float32"),
             "--bench", "2", "--bench-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["steps"] == 2 and res["cached"]["tok_s"] > 0 and res["ratio"] > 0 and len(res["rows"]) == 3
    assert all(r["uncached_loss"] == pytest.approx(r["cached_loss"], rel=1e-4) for r in res["rows"])
    # bfloat16 compute: a third arm separates the cache's gain from the precision's; the loss stays close
    r = dmtd("train", "--run-dir", str(tmp_path / "b16"), *common, "--cache", str(corpus / "cache-e0-d2-k97-float32"),
             "--compute-dtype", "bfloat16", "--bench", "2", "--bench-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["arms"] == ["uncached", "cached_float32", "cached"] and res["compute_dtype"] == "bfloat16"
    assert res["ratio_cache_only"] > 0 and res["cached"]["tok_s"] > 0
    assert all(r["cached_float32_loss"] == pytest.approx(r["uncached_loss"], rel=1e-4) for r in res["rows"])
    assert all(r["cached_loss"] == pytest.approx(r["cached_float32_loss"], rel=0.05) for r in res["rows"])
    r = dmtd("train", "--run-dir", str(tmp_path / "b2"), *common, "--bench", "2")
    assert r.returncode == 2 and "--bench" in r.stderr and "--cache" in r.stderr
    r = dmtd("train", "--run-dir", str(tmp_path / "b3"), *common, "--temperatures", "0,warm", "--max-steps", "1")
    assert r.returncode == 2 and "--temperatures: must be comma-separated numbers" in r.stderr
    r = dmtd("cache", "--corpus", str(corpus), "--model", str(tiny_dir), "--temperatures", "hot")
    assert r.returncode == 2 and "--temperatures" in r.stderr and "Traceback" not in r.stderr
    r = dmtd("train", "--run-dir", str(tmp_path / "run"), *common, "--cache", "auto", "--max-steps", "2")
    assert r.returncode == 2 and "cache-e0-d2-k64-bfloat16" in r.stderr and "Traceback" not in r.stderr
    r = dmtd("train", "--run-dir", str(tmp_path / "run"), *common, "--max-steps", "4", "--eval-every", "2",
             "--eval-records", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "curve.png").is_file()
    evals = [d for d in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines()) if "eval" in d]
    assert [d["step"] for d in evals] == [0, 2, 4] and all(0 <= v <= 1 for d in evals for v in d["eval"].values())
    r = dmtd("train", "--run-dir", str(tmp_path / "run"), "--plot", str(tmp_path / "c.png"))
    assert r.returncode == 0 and (tmp_path / "c.png").stat().st_size > 1000
    r = dmtd("data", "--out", str(tmp_path / "snap"), "--snapshot-of", str(corpus), "--shards", "2")
    assert r.returncode == 0 and "snapshot of 2 shards" in r.stdout
    r = dmtd("data", "--out", str(tmp_path / "snap3"), "--snapshot-of", str(corpus), "--shards", "0")
    assert r.returncode == 2 and "--shards must lie in 1..4" in r.stderr


def test_snapshot_of_a_growing_corpus_is_served_by_its_cache(tiny_dir: Path, tiny_corpus_dir: Path,
                                                              exact_cache: Path, tmp_path: Path):
    from dmtd.train.corpus import CorpusError, load_corpus, snapshot_corpus

    snap = snapshot_corpus(tiny_corpus_dir, tmp_path / "snap", 2)
    full = load_corpus(tiny_corpus_dir)
    assert [s.name for s in snap.shards] == ["shard-00000.jsonl", "shard-00001.jsonl"] and not snap.complete
    assert load_corpus(tmp_path / "snap").records == full.records[: sum(s.num_records for s in snap.shards)]
    cfg = train_config(tiny_dir, tmp_path / "snap", cache=str(exact_cache), max_steps=2)
    assert Trainer(cfg, tmp_path / "run", progress=False).run().step == 2
    with pytest.raises(CorpusError, match="--shards must lie in 1..4"):
        snapshot_corpus(tiny_corpus_dir, tmp_path / "snap2", 9)
    with pytest.raises(CorpusError, match="not empty"):
        snapshot_corpus(tiny_corpus_dir, tmp_path / "snap", 1)
