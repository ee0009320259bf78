"""Bad input fails with a clear error before any work starts (typed errors; exit code 2 from the CLI)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dmtd.train.checkpoint import CheckpointError
from dmtd.train.corpus import CorpusError
from dmtd.train.export import export_variant
from dmtd.train.trainer import Trainer
from dmtd.variants.build import engine_spec
from dmtd.variants.manifest import ManifestError
from tests.train.helpers import save_tiny, train_config
from tests.train.test_e2e_cli import dmtd


@pytest.fixture(scope="module")
def lora_variant(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("variant")
    cfg = train_config(tiny_dir, tiny_corpus_dir, scope="lora", lora_rank=2, max_steps=2)
    t = Trainer(cfg, root / "run", progress=False)
    t.run()
    export_variant(t.student, cfg, root / "v", t.fingerprint, t.corpus.content_hash)
    return root / "v"


def edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "variant.json").read_text())
    m.update(changes)
    (dst / "variant.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("changes,words", [
    (dict(num_thinking_layers=5), "does not fit base model.*must equal the model's num_hidden_layers"),
    (dict(vocab_size=49152), "vocab_size 49152 in the manifest, 97 in the model"),
    (dict(base_fingerprint="0" * 64), "base checksum .* differs"),
    (dict(adapter_sha256="0" * 64), "adapter checksum mismatch"),
])
def test_manifest_that_does_not_fit_the_base(changes, words, lora_variant: Path, tiny_dir: Path, tmp_path: Path):
    v = edited(lora_variant, tmp_path / "v", **changes)
    with pytest.raises(ManifestError, match=words):
        engine_spec(str(tiny_dir), str(v))


def test_adapter_made_for_another_base(lora_variant: Path, tmp_path: Path):
    other = save_tiny(tmp_path / "other", seed=1)  # same shapes, other weights
    v = edited(lora_variant, tmp_path / "v", base_fingerprint=None)
    with pytest.raises(ManifestError, match="made for another base model"):
        engine_spec(str(other), str(v))


def test_corpus_for_another_base_and_missing_corpus(tiny_corpus_dir: Path, tmp_path: Path):
    other = save_tiny(tmp_path / "other", seed=1)
    with pytest.raises(CorpusError, match="made with another base model"):
        Trainer(train_config(other, tiny_corpus_dir), tmp_path / "run", progress=False)
    with pytest.raises(CorpusError, match="not found"):
        Trainer(train_config(other, tmp_path / "nope"), tmp_path / "run", progress=False)


def test_corrupted_checkpoint_is_refused(tiny_dir: Path, tiny_corpus_dir: Path, tmp_path: Path):
    cfg = train_config(tiny_dir, tiny_corpus_dir, max_steps=2)
    Trainer(cfg, tmp_path / "run", progress=False).run()
    ck = tmp_path / "run" / "ckpt-000002.pt"
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ck.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        Trainer(cfg, tmp_path / "run", progress=False)
    (tmp_path / "run" / "checksums.json").unlink()  # without the record, the torn file itself is caught
    ck.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(CheckpointError, match="unreadable or corrupted"):
        Trainer(cfg, tmp_path / "run", progress=False)


def test_cli_maps_training_errors_to_exit_2(tiny_dir: Path, tiny_corpus_dir: Path, lora_variant: Path,
                                            tmp_path: Path):
    r = dmtd("train", "--run-dir", str(tmp_path / "r"), "--corpus", str(tmp_path / "missing"),
             "--base-model", str(tiny_dir), "--num-decoding-layers", "2")
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = dmtd("train", "--run-dir", str(tmp_path / "r"), "--corpus", str(tiny_corpus_dir), "--base-model",
             str(tiny_dir), "--num-decoding-layers", "6")
    assert r.returncode == 2 and "thinking layer" in r.stderr
    r = dmtd("train", "--run-dir", str(tmp_path / "r"), "--corpus", str(tiny_corpus_dir), "--tau-min", "5")
    assert r.returncode == 2 and "tau_min (5) must be <= tau_max (4)" in r.stderr
    bad = edited(lora_variant, tmp_path / "v", num_decoding_layers=3)
    r = dmtd("eval", "--variant", str(bad), "--model", str(tiny_dir), "--quick")
    assert r.returncode == 2 and "does not fit base model" in r.stderr and "Traceback" not in r.stderr
