"""The teacher cache: what a frozen trunk feeds the decoding layers, and what the teacher says, once per shard.

With nothing below the decoding layers training (``--scope decoding``), the decoding layers' inputs and
the base model's distribution at every corpus position do not depend on the trained weights. ``dmtd
cache`` computes them once; a cached training step then runs only the decoding layers and the head.

Layout, beside the corpus shards (``CORPUS/cache-e{E}-d{D}-k{k}-{dtype}/``)::

    cache.json                   format, CacheSpec, base model fingerprint
    shard-00000.json             the corpus shard's SHA-256, each array's SHA-256 and shape, build time
    shard-00000.hidden.npy       h_think [tokens, H] at every position (bf16 bits as uint16, or float32)
    shard-00000.enc.npy          h_enc [tokens, H], only when E > 0 (E = 0: the embeddings, recomputed)
    shard-00000.topk_ids.npy     the teacher's top-k token ids [targets, k] int32, most likely first
    shard-00000.topk_logp.npy    their log-probs [targets, k] float32
    shard-00000.rest.npy         log of the teacher's mass outside the k ids [targets] float32
    shard-00000.index.npy        per record: idx, token offset, tokens, target offset, targets (int64)

Targets cover a record's continuation positions ``p−1 … n−2`` (the positions that predict a completion
token). Opening a cache checks the spec, the base fingerprint, that every corpus shard has an entry made
from the same shard bytes, every array's SHA-256 and every record's length: a stale or corrupt cache
fails before any step, never trains on wrong targets.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dmtd.train.batches import Batch, make_batch
from dmtd.train.corpus import Corpus, Record, parse_records, read_manifest, sha256_bytes
from dmtd.train.metrics import TopKTargets
from dmtd.train.student import DMTDStudent
from dmtd.variants.manifest import sha256_file

CACHE_FORMAT = "dmtd-teacher-cache-v1"
CACHE_MANIFEST = "cache.json"
ARRAYS = ("hidden", "enc", "topk_ids", "topk_logp", "rest", "index")


class CacheError(ValueError):
    """A teacher cache is missing, incomplete, corrupted, or was made for another corpus, base model or split."""


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """What a cache holds: the layer split it serves, how many teacher ids per position, hidden precision."""

    num_encoding_layers: int
    num_decoding_layers: int
    top_k: int = 64
    hidden_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # only the records sampled at these temperatures (e.g. (0.0,): the greedy ones, a third of a default corpus's
    # records at a third of the time); None = every record
    temperatures: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.temperatures is not None:
            object.__setattr__(self, "temperatures", tuple(sorted(float(t) for t in self.temperatures)))
            if not self.temperatures:
                raise CacheError("temperatures must name at least one temperature (or be None: every record)")
        if self.num_encoding_layers < 0:
            raise CacheError(f"num_encoding_layers must be >= 0, got {self.num_encoding_layers}")
        if self.num_decoding_layers < 1:
            raise CacheError(f"num_decoding_layers must be >= 1, got {self.num_decoding_layers}")
        if self.top_k < 1:
            raise CacheError(f"top_k must be >= 1, got {self.top_k}")
        if self.hidden_dtype not in ("bfloat16", "float32"):
            raise CacheError(f"hidden_dtype must be bfloat16 or float32, got {self.hidden_dtype!r}")

    @property
    def dirname(self) -> str:
        temps = "" if self.temperatures is None else "-t" + "_".join(f"{t:g}" for t in self.temperatures)
        return f"cache-e{self.num_encoding_layers}-d{self.num_decoding_layers}-k{self.top_k}-{self.hidden_dtype}{temps}"

    def holds(self, r: Record) -> bool:
        """Whether a record belongs in this cache."""
        return self.temperatures is None or r.temperature in self.temperatures


def default_cache_dir(corpus: Path, spec: CacheSpec) -> Path:
    return Path(corpus).expanduser() / spec.dirname


def _file(root: Path, shard: str, array: str) -> Path:
    return root / f"{shard.removesuffix('.jsonl')}.{array}.npy"


def _meta_path(root: Path, shard: str) -> Path:
    return root / f"{shard.removesuffix('.jsonl')}.json"


def _save_npy(path: Path, a: np.ndarray) -> str:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        np.save(f, a)
    os.replace(tmp, path)
    return sha256_file(path)


def _to_store(h: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return h.float().numpy()


def _from_store(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.view(torch.int16).view(torch.bfloat16).float() if dtype == "bfloat16" else t


def teacher_targets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids, their log-probs and the log of the remaining mass, from logits [N, V]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    vals, ids = logp.topk(k, dim=-1)
    if k == logp.shape[-1]:
        rest = torch.full(vals.shape[:1], float("-inf"))
    else:
        rest = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), dim=-1)
    return ids.int(), vals, rest


def _open_root(root: Path, spec: CacheSpec | None, fingerprint: str, create: bool) -> CacheSpec:
    """Create (``create``) or check a cache directory's manifest; returns its spec."""
    mpath = root / CACHE_MANIFEST
    if not mpath.is_file():
        if not create or spec is None:
            raise CacheError(f"{str(root)!r} is not a teacher cache ({CACHE_MANIFEST} is missing); build it with "
                             "`dmtd cache --corpus CORPUS`")
        root.mkdir(parents=True, exist_ok=True)
        want = {"format": CACHE_FORMAT, "spec": asdict(spec), "base_fingerprint": fingerprint}
        mpath.write_text(json.dumps(want, indent=1) + "\n")
        return spec
    try:
        have = json.loads(mpath.read_text())
        stored = CacheSpec(**have["spec"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CacheError(f"{mpath}: corrupted ({e})") from e
    if have.get("format") != CACHE_FORMAT:
        raise CacheError(f"{mpath}: not a {CACHE_FORMAT} cache")
    if have.get("base_fingerprint") != fingerprint:
        raise CacheError(f"teacher cache {str(root)!r} was made from another base model")
    if spec is not None and stored != spec:
        raise CacheError(f"teacher cache {str(root)!r} holds {asdict(stored)}, not {asdict(spec)}")
    return stored


def _read_meta(root: Path, shard: str) -> dict | None:
    p = _meta_path(root, shard)
    if not p.is_file():
        return None
    try:
        return dict(json.loads(p.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CacheError(f"{p}: corrupted ({e})") from e


@torch.no_grad()
def build_shard(student: DMTDStudent, records: list[Record], spec: CacheSpec,
                batch_size: int) -> dict[str, np.ndarray]:
    """The cache arrays of one shard's records (in shard order), computed in micro-batches of similar length."""
    n_rec = len(records)
    order = sorted(range(n_rec), key=lambda i: (records[i].num_tokens, i))
    per: dict[int, tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]] = {}
    dev = student.model.embed_tokens.weight.device
    for a in range(0, n_rec, batch_size):
        idx = order[a: a + batch_size]
        recs = [records[i] for i in idx]
        b = make_batch(recs, [1] * len(recs), student.dmtd, max(r.num_tokens for r in recs)).to(dev)
        h_enc, h_think, logits = student.frozen_pass(b.input_ids, b.loss_mask)
        ids, logp, rest = teacher_targets(logits, spec.top_k)
        off = 0
        for j, (i, r) in enumerate(zip(idx, recs)):
            n, m = r.num_tokens, r.num_tokens - len(r.prompt_ids)
            enc = h_enc[j, :n].cpu() if spec.num_encoding_layers else None
            per[i] = (h_think[j, :n].cpu(), enc, (ids[off: off + m].cpu(), logp[off: off + m].cpu(),
                                                   rest[off: off + m].cpu()))
            off += m
    hidden = torch.cat([per[i][0] for i in range(n_rec)])
    tgt = [torch.cat([per[i][2][k] for i in range(n_rec)]) for k in range(3)]
    ntok = [r.num_tokens for r in records]
    ntgt = [r.num_tokens - len(r.prompt_ids) for r in records]
    index = np.stack([[r.idx for r in records], np.cumsum([0] + ntok[:-1]), ntok,
                      np.cumsum([0] + ntgt[:-1]), ntgt], axis=1).astype(np.int64)
    out = {"hidden": _to_store(hidden, spec.hidden_dtype), "topk_ids": tgt[0].numpy(),
           "topk_logp": tgt[1].float().numpy(), "rest": tgt[2].float().numpy(), "index": index}
    if spec.num_encoding_layers:
        out["enc"] = _to_store(torch.cat([e for _, e, _ in (per[i] for i in range(n_rec)) if e is not None]),
                               spec.hidden_dtype)
    return out


def build_cache(corpus_root: Path, student: DMTDStudent, spec: CacheSpec, fingerprint: str,
                out: Path | None = None, batch_size: int = 4, progress: bool = True, follow: bool = False,
                poll_s: float = 60.0) -> Path:
    """Cache every finished corpus shard not yet cached (resumable: a shard is done once its meta exists).

    ``follow``: keep waiting for new shards until the corpus is complete (for a corpus still being made).
    """
    if not student.trunk_frozen:
        raise CacheError("a teacher cache needs a frozen trunk (--scope decoding)")
    root = Path(out or default_cache_dir(corpus_root, spec)).expanduser()
    _open_root(root, spec, fingerprint, create=True)
    while True:
        m = read_manifest(Path(corpus_root).expanduser())
        if m.config.base_fingerprint != fingerprint:
            raise CacheError(f"corpus {str(corpus_root)!r} was made with another base model")
        todo = [s for s in m.shards if (_read_meta(root, s.name) or {}).get("corpus_sha256") != s.sha256]
        for s in tqdm(todo, desc="dmtd cache", unit="shard", disable=not progress, dynamic_ncols=True):
            data = (Path(corpus_root).expanduser() / s.name).read_bytes()
            if sha256_bytes(data) != s.sha256:
                raise CacheError(f"corpus shard {s.name} does not match its SHA-256 in corpus.json")
            records = [r for r in parse_records(data, s.name) if spec.holds(r)]
            t0 = time.perf_counter()
            arrays = build_shard(student, records, spec, batch_size)
            files = {a: {"sha256": _save_npy(_file(root, s.name, a), v), "shape": list(v.shape)}
                     for a, v in arrays.items()}
            dt = time.perf_counter() - t0
            meta = {"shard": s.name, "corpus_sha256": s.sha256, "num_records": len(records),
                    "num_tokens": int(arrays["index"][:, 2].sum()), "build_s": round(dt, 2), "files": files}
            tmp = _meta_path(root, s.name).with_suffix(".json.tmp")
            tmp.write_text(json.dumps(meta, indent=1) + "\n")
            os.replace(tmp, _meta_path(root, s.name))
        if not follow or m.complete:
            return root
        time.sleep(poll_s)


@dataclass(slots=True)
class _Shard:
    arrays: dict[str, np.ndarray]
    rows: dict[int, tuple[int, int, int, int]]  # record idx -> token offset, tokens, target offset, targets


class TeacherCache:
    """An opened, verified cache: per-record decoding-layer inputs and teacher targets for training batches."""

    def __init__(self, root: Path, corpus: Corpus, fingerprint: str, hidden_size: int,
                 split: tuple[int, int]) -> None:
        """Open ``root`` for ``corpus`` and verify it; ``split`` is the run's (E, D)."""
        self.root = Path(root).expanduser()
        self.spec = spec = _open_root(self.root, None, fingerprint, create=False)
        if (spec.num_encoding_layers, spec.num_decoding_layers) != split:
            raise CacheError(f"teacher cache {str(self.root)!r} serves E = {spec.num_encoding_layers}, D = "
                             f"{spec.num_decoding_layers}; this run has E = {split[0]}, D = {split[1]}")
        self._by_idx: dict[int, _Shard] = {}
        self.metas: list[dict] = []
        h = hashlib.sha256(json.dumps({"spec": asdict(spec), "base": fingerprint}, sort_keys=True).encode())
        counts = {}
        for r in corpus.records:
            if spec.holds(r):
                counts[r.idx] = (r.num_tokens, r.num_tokens - len(r.prompt_ids))
        for s in corpus.manifest.shards:
            meta = _read_meta(self.root, s.name)
            if meta is None:
                raise CacheError(f"teacher cache {str(self.root)!r} lacks corpus shard {s.name}; run `dmtd cache "
                                 f"--corpus {corpus.root}` (resumes where it stopped)")
            if meta.get("corpus_sha256") != s.sha256:
                raise CacheError(f"teacher cache entry for {s.name} is stale: made from other shard bytes than "
                                 "the corpus holds now; rebuild it with `dmtd cache`")
            arrays = {}
            for a in ARRAYS:
                if a == "enc" and not spec.num_encoding_layers:
                    continue
                f, info = _file(self.root, s.name, a), meta.get("files", {}).get(a)
                if info is None or not f.is_file():
                    raise CacheError(f"teacher cache {str(self.root)!r}: {f.name} is missing")
                if sha256_file(f) != info["sha256"]:
                    raise CacheError(f"teacher cache {str(self.root)!r}: {f.name} is corrupted (SHA-256 mismatch)")
                arrays[a] = np.load(f, mmap_mode="r")
            h.update(s.sha256.encode() + json.dumps(meta["files"], sort_keys=True).encode())
            self.metas.append(meta)
            self._check_shapes(s.name, arrays, hidden_size)
            shard = _Shard(arrays, {})
            for idx, tok_off, ntok, tgt_off, ntgt in arrays["index"].tolist():
                if counts.get(idx) != (ntok, ntgt):
                    raise CacheError(f"teacher cache entry for {s.name}: record {idx} has {ntok} tokens / {ntgt} "
                                     f"targets, the corpus {counts.get(idx)}")
                shard.rows[idx] = (tok_off, ntok, tgt_off, ntgt)
                self._by_idx[idx] = shard
        self.content_hash = h.hexdigest()

    def build_rate(self) -> dict[str, float]:
        """How fast the cache was built: tokens and seconds over its shards, and tokens/s."""
        tok = sum(int(m["num_tokens"]) for m in self.metas)
        sec = sum(float(m.get("build_s", 0.0)) for m in self.metas)
        return {"tokens": tok, "seconds": round(sec, 1), "tok_s": round(tok / sec, 1) if sec else 0.0}

    def _check_shapes(self, name: str, a: dict[str, np.ndarray], hidden_size: int) -> None:
        ntok, ntgt = int(a["index"][:, 2].sum()), int(a["index"][:, 4].sum())
        k = self.spec.top_k
        want = {"hidden": (ntok, hidden_size), "enc": (ntok, hidden_size), "rest": (ntgt,)}
        for key, shape in want.items():
            if key in a and a[key].shape != shape:
                raise CacheError(f"teacher cache entry for {name}: {key} has shape {a[key].shape}, expected {shape}")
        if a["topk_ids"].shape[0] != ntgt or a["topk_ids"].shape != a["topk_logp"].shape or \
                a["topk_ids"].shape[1] > k:
            raise CacheError(f"teacher cache entry for {name}: top-k arrays have shape {a['topk_ids'].shape}")

    def inputs(self, records: list[Record], batch: Batch, embed: torch.nn.Embedding
               ) -> tuple[torch.Tensor, torch.Tensor, TopKTargets]:
        """``h_enc``, ``h_think`` [B, T, H] and the teacher's targets at ``batch.loss_mask`` (row-major)."""
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        h_think = torch.zeros(B, T, embed.embedding_dim)
        h_enc = torch.zeros(B, T, embed.embedding_dim) if self.spec.num_encoding_layers else None
        ids, logp, rest = [], [], []
        for b, r in enumerate(records):
            sh = self._by_idx.get(r.idx)
            if sh is None:
                raise CacheError(f"record {r.idx} is not in the teacher cache {str(self.root)!r}")
            tok_off, _, tgt_off, _ = sh.rows[r.idx]
            n = batch.lengths[b]
            m = n - min(len(r.prompt_ids), n)
            a = sh.arrays
            h_think[b, :n] = _from_store(a["hidden"][tok_off: tok_off + n], self.spec.hidden_dtype)
            if h_enc is not None:
                h_enc[b, :n] = _from_store(a["enc"][tok_off: tok_off + n], self.spec.hidden_dtype)
            ids.append(torch.from_numpy(np.array(a["topk_ids"][tgt_off: tgt_off + m])))
            logp.append(torch.from_numpy(np.array(a["topk_logp"][tgt_off: tgt_off + m])))
            rest.append(torch.from_numpy(np.array(a["rest"][tgt_off: tgt_off + m])))
        if h_enc is None:
            with torch.no_grad():
                h_enc = embed(batch.input_ids)
        t = TopKTargets(torch.cat(ids).to(dev), torch.cat(logp).to(dev), torch.cat(rest).to(dev))
        return h_enc.to(dev), h_think.to(dev), t
