"""Training checkpoints: trainable tensors, optimizer state, step and config, written atomically and hashed.

A run directory holds ``ckpt-NNNNNN.pt`` files and ``latest.json`` naming the newest one with its
SHA-256, so a torn or tampered checkpoint is refused before any work starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dmtd.variants.manifest import sha256_file as _sha256

CKPT_FORMAT = "dmtd-train-ckpt-v1"
LATEST = "latest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or belongs to another run (config, corpus or base model)."""


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (must hold ``step``) atomically, point ``latest.json`` at it, prune old ones."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ckpt_name(int(state["step"]))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"format": CKPT_FORMAT, **state}, tmp)
    os.replace(tmp, path)
    digest = _sha256(path)
    latest = {"checkpoint": path.name, "sha256": digest, "step": int(state["step"])}
    tmp_l = run_dir / f".{LATEST}.tmp-{os.getpid()}"
    tmp_l.write_text(json.dumps(latest, indent=1) + "\n")
    os.replace(tmp_l, run_dir / LATEST)
    hashes = _hashes(run_dir)
    hashes[path.name] = digest
    olds = sorted(p for p in run_dir.glob("ckpt-*.pt"))[:-keep]
    for old in olds:
        old.unlink(missing_ok=True)
        hashes.pop(old.name, None)
    (run_dir / "checksums.json").write_text(json.dumps(hashes, indent=1) + "\n")
    return path


def _hashes(run_dir: Path) -> dict[str, str]:
    p = run_dir / "checksums.json"
    try:
        return dict(json.loads(p.read_text())) if p.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run directory, or None for a fresh run (no ``latest.json``)."""
    lp = run_dir / LATEST
    if not lp.is_file():
        if list(run_dir.glob("ckpt-*.pt")):
            raise CheckpointError(f"{run_dir}: checkpoints present but {LATEST} is missing; "
                                  "pass one with --resume-from")
        return None
    try:
        d = json.loads(lp.read_text())
        return run_dir / str(d["checkpoint"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{lp}: corrupted ({e})") from e


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint (SHA-256 from the run's records when known, then its structure)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    known = _hashes(path.parent).get(path.name)
    if known is not None and _sha256(path) != known:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted (SHA-256 mismatch with checksums.json)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a torn or foreign file
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable or corrupted: {e}") from e
    if not isinstance(state, dict) or state.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a dmtd training checkpoint ({CKPT_FORMAT})")
    for key in ("step", "config", "trainable", "optimizer", "corpus_hash", "base_fingerprint"):
        if key not in state:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {key!r}")
    return state
