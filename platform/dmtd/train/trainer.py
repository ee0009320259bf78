"""``dmtd train``: the cyclical-masking fine-tuning recipe, top to bottom.

config → base model + corpus (checked) → student/teacher → AdamW → one loop: batches (a pure function
of the step) → loss → clip → step → log → checkpoint (exact resume) → export.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

from dmtd.engine.config import ConfigError, DMTDConfig
from dmtd.train.batches import DataOrder, draw_routing, make_batch
from dmtd.train.cache import CacheError, CacheSpec, TeacherCache, default_cache_dir
from dmtd.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from dmtd.train.config import RESUMABLE_CHANGES, TrainConfig
from dmtd.train.corpus import Corpus, CorpusError, load_corpus
from dmtd.train.lora import LoRAAdapters, parse_layers
from dmtd.train.metrics import TopKTargets, batch_weight, distill_loss, distill_loss_fused, teacher_forced
from dmtd.train.plots import plot_curve
from dmtd.train.student import DMTDStudent
from dmtd.variants.loader import LoadedModel, load_model
from dmtd.variants.manifest import base_fingerprint


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine down to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def dmtd_of_split(e: int, d: int, num_layers: int, tau_max: int = 1, phase_anchor: str = "prompt_end",
                  head_input: str = "replace") -> DMTDConfig:
    """The routing of a layer split (E encoding, D decoding layers, the rest thinking)."""
    t = num_layers - e - d
    if t < 1:
        raise ConfigError(f"num_encoding_layers ({e}) + num_decoding_layers ({d}) must leave >= 1 thinking layer "
                          f"of {num_layers}")
    return DMTDConfig(e, t, d, tau_max, phase_anchor, head_input)  # type: ignore[arg-type]


def dmtd_of(cfg: TrainConfig, num_layers: int) -> DMTDConfig:
    return dmtd_of_split(cfg.num_encoding_layers, cfg.num_decoding_layers, num_layers, cfg.tau_max,
                         cfg.phase_anchor, cfg.head_input)


@dataclass(slots=True)
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    last: dict[str, float] = field(default_factory=dict)


class Trainer:
    """One training run in ``run_dir``; constructing it validates every input and resumes if it can."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, loaded: LoadedModel | None = None,
                 progress: bool = True, resume_from: Path | None = None) -> None:
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir).expanduser(), progress
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        ckpt = None
        path = resume_from if resume_from is not None else (
            latest_checkpoint(self.run_dir) if self.run_dir.is_dir() else None)
        if path is not None:
            ckpt = load_checkpoint(Path(path))
            self._check_resume(ckpt)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.loaded = loaded or load_model(cfg.base_model, device=str(self.device), tokenizer=False)
        self.fingerprint = base_fingerprint(self.loaded.path)
        self.corpus = self._open_corpus()
        self.dmtd = dmtd_of(cfg, self.loaded.config.num_layers)
        model = self.loaded.model
        lora = None
        if cfg.scope == "lora":
            try:
                layers = parse_layers(cfg.lora_layers, model.config.num_layers, self.dmtd.decoding_start)
                lora = LoRAAdapters(model, layers, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, cfg.seed)
            except ValueError as e:
                raise ConfigError(f"lora: {e}") from e
        self.student = DMTDStudent(model, self.dmtd, cfg.scope, lora, cfg.lora_train_norms)
        self.params = self.student.named_trainable()
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay, foreach=False)
        self.train_records = self.corpus.split("train")
        self.heldout = self.corpus.split("heldout")
        if cfg.temperatures is not None:
            self.train_records = [r for r in self.train_records if r.temperature in cfg.temperatures]
        if not self.train_records:
            where = "" if cfg.temperatures is None else f" at temperatures {cfg.temperatures}"
            raise CorpusError(f"corpus {cfg.corpus!r} has no training records{where}")
        self.cache = self._open_cache() if cfg.cache else None
        self.order = DataOrder([min(r.num_tokens, cfg.max_len) for r in self.train_records], cfg.batch_size,
                               cfg.seed)
        self.state = TrainState()
        if ckpt is not None:
            self._restore(ckpt)
        elif cfg.init_from is not None:
            self._init_from(Path(cfg.init_from).expanduser())

    # -- inputs -----------------------------------------------------------------------------------
    def _open_corpus(self) -> Corpus:
        corpus = load_corpus(Path(self.cfg.corpus), vocab_size=self.loaded.config.vocab_size)
        if corpus.manifest.config.base_fingerprint != self.fingerprint:
            raise CorpusError(f"corpus {self.cfg.corpus!r} was made with another base model "
                              f"({corpus.manifest.config.base_model}), not {self.loaded.path}")
        return corpus

    def _open_cache(self) -> TeacherCache:
        cfg = self.cfg
        assert cfg.cache is not None
        if not self.student.trunk_frozen:
            raise CacheError("--cache needs a frozen trunk (scope decoding)")
        root = Path(cfg.cache).expanduser()
        if cfg.cache == "auto":
            root = default_cache_dir(Path(cfg.corpus), CacheSpec(
                cfg.num_encoding_layers, cfg.num_decoding_layers,
                temperatures=None if cfg.temperatures is None else tuple(cfg.temperatures)))
        cache = TeacherCache(root, self.corpus, self.fingerprint, self.loaded.config.hidden_size,
                             (cfg.num_encoding_layers, cfg.num_decoding_layers))
        held = cache.spec.temperatures
        if held is not None and (cfg.temperatures is None or not set(cfg.temperatures) <= set(held)):
            raise CacheError(f"teacher cache {str(root)!r} holds only the records sampled at temperatures "
                             f"{list(held)}; train with --temperatures {','.join(f'{t:g}' for t in held)} (or a "
                             f"subset), not {'every record' if cfg.temperatures is None else cfg.temperatures}")
        return cache

    def _check_resume(self, ckpt: dict[str, Any]) -> None:
        try:
            old = TrainConfig.model_validate(ckpt["config"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint config is invalid: {str(e).splitlines()[0]}") from e
        a, b = old.identity(), self.cfg.identity()
        diff = sorted(k for k in a if a[k] != b.get(k))
        if diff:
            raise CheckpointError(f"{self.run_dir} holds a run with a different config ({', '.join(diff)}); "
                                  f"use another --run-dir or the same settings (may change: "
                                  f"{', '.join(RESUMABLE_CHANGES)})")

    def _restore(self, ckpt: dict[str, Any]) -> None:
        if ckpt["corpus_hash"] != self.corpus.content_hash:
            raise CheckpointError("the checkpoint was trained on another corpus (content hash "
                                  f"{str(ckpt['corpus_hash'])[:12]}…, now {self.corpus.content_hash[:12]}…)")
        if ckpt["base_fingerprint"] != self.fingerprint:
            raise CheckpointError("the checkpoint was trained from another base model")
        cache_hash = self.cache.content_hash if self.cache is not None else None
        if ckpt.get("cache_hash") != cache_hash:
            raise CheckpointError("the checkpoint was trained from another teacher cache (or without one)")
        names = set(self.params)
        if set(ckpt["trainable"]) != names:
            raise CheckpointError("the checkpoint's trainable tensors do not match this run's scope")
        with torch.no_grad():
            for n, p in self.params.items():
                t = ckpt["trainable"][n]
                if t.shape != p.shape:
                    raise CheckpointError(f"checkpoint tensor {n} has shape {tuple(t.shape)}, expected "
                                          f"{tuple(p.shape)}")
                p.copy_(t)
        self.opt.load_state_dict(ckpt["optimizer"])
        self.state = TrainState(int(ckpt["step"]), int(ckpt.get("tokens_seen", 0)),
                                float(ckpt.get("elapsed_s", 0.0)), dict(ckpt.get("last", {})))

    def _init_from(self, path: Path) -> None:
        if path.is_dir() or path.suffix == ".json":  # an exported variant (e.g. the shipped one, in the repo)
            trainable, fingerprint = self._variant_tensors(path), self.fingerprint
        else:
            src = load_checkpoint(path)
            trainable, fingerprint = src["trainable"], src["base_fingerprint"]
        if fingerprint != self.fingerprint:
            raise CheckpointError(f"--init-from {path}: trained from another base model")
        missing = sorted(set(self.params) - set(trainable))
        if missing:
            raise CheckpointError(f"--init-from {path}: lacks {len(missing)} of this run's trainable tensors "
                                  f"(first: {missing[0]}); was it trained with another scope or split?")
        with torch.no_grad():
            for n, p in self.params.items():
                if trainable[n].shape != p.shape:
                    raise CheckpointError(f"--init-from {path}: tensor {n} has another shape")
                p.copy_(trainable[n])

    def _variant_tensors(self, path: Path) -> dict[str, torch.Tensor]:
        """The tensors of a variant directory merged over the base model (its adapter applied), by name."""
        from dmtd.variants.build import apply_variant_weights
        from dmtd.variants.manifest import ManifestError, read_manifest

        try:
            manifest = read_manifest(path)
            if manifest.num_decoding_layers != self.cfg.num_decoding_layers or \
                    manifest.num_encoding_layers != self.cfg.num_encoding_layers:
                raise CheckpointError(f"--init-from {path}: a variant with E={manifest.num_encoding_layers}, "
                                      f"D={manifest.num_decoding_layers}; this run has E={self.cfg.num_encoding_layers}"
                                      f", D={self.cfg.num_decoding_layers}")
            loaded = load_model(self.cfg.base_model, device=str(self.device), tokenizer=False)
            apply_variant_weights(loaded, manifest, path if path.is_dir() else path.parent)
        except ManifestError as e:
            raise CheckpointError(f"--init-from {path}: {e}") from e
        return {n: p.detach() for n, p in loaded.model.named_parameters()}

    # -- the loop ---------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        batches, records = [], []
        for k in range(cfg.grad_accum):
            idx = step * cfg.grad_accum + k
            recs = [self.train_records[i] for i in self.order.micro_batch(idx)]
            taus, firsts = draw_routing(cfg.seed, idx, len(recs), cfg.tau_min, cfg.tau_max, cfg.phase_jitter)
            batches.append(make_batch(recs, taus, self.dmtd, cfg.max_len, firsts).to(self.device))
            records.append(recs)
        total = sum(batch_weight(b, cfg.head_weight, cfg.tail_weight) for b in batches) or 1.0
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        self.opt.zero_grad(set_to_none=True)
        agg: dict[str, float] = {"loss": 0.0}
        amp = cfg.compute_dtype == "bfloat16"
        for b, recs in zip(batches, records):
            teacher: torch.Tensor | TopKTargets
            is_tail = ~b.head_mask[b.loss_mask]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=amp):
                if self.cache is not None:  # the frozen trunk's states and the teacher's targets, precomputed
                    h_enc, h_think, teacher = self.cache.inputs(recs, b, self.loaded.model.embed_tokens)
                    h = self.student.decode_hidden(h_enc, h_think, b.head_mask, b.loss_mask)
                else:
                    ls, teacher = self.student.forward_pair(b.input_ids, b.head_mask, b.loss_mask)
            if isinstance(teacher, TopKTargets):  # head and loss fused, chunk by chunk (dmtd.train.fused_loss)
                loss, stats = distill_loss_fused(h, self.student.head_weight, teacher, b.targets[b.loss_mask],
                                                 is_tail, cfg.kl_weight, cfg.ce_weight, cfg.head_weight,
                                                 cfg.tail_weight, total,
                                                 torch.bfloat16 if amp else torch.float32)
            else:
                loss, stats = distill_loss(ls, teacher, b.targets[b.loss_mask], is_tail, cfg.kl_weight,
                                           cfg.ce_weight, cfg.head_weight, cfg.tail_weight, total)
            loss.backward()
            agg["loss"] += float(loss.detach())
            for key, v in stats.items():
                agg[key] = agg.get(key, 0.0) + v / len(batches)
        agg["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), cfg.grad_clip))
        self.opt.step()
        agg["lr"] = lr_at(step, cfg)
        agg["tokens"] = float(sum(b.num_tokens for b in batches))
        return agg

    def run(self, stop_at: int | None = None) -> TrainState:
        """Train to ``max_steps`` (or stop after ``stop_at`` steps, as an interruption would), checkpointing."""
        cfg, st = self.cfg, self.state
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=1) + "\n")
        end = min(cfg.max_steps, stop_at if stop_at is not None else cfg.max_steps)
        bar = tqdm(total=cfg.max_steps, initial=st.step, unit="step", desc=f"dmtd train {cfg.name}",
                   disable=not self.progress, dynamic_ncols=True)
        log = self._open_log()
        try:
            if cfg.eval_every and st.step == 0 and end > 0:  # where the curve starts: the floor, or --init-from's
                log.write(json.dumps({"step": 0, "tokens_seen": 0, "eval": self.heldout_agreement()}) + "\n")
                log.flush()
            while st.step < end:
                t0 = time.perf_counter()
                stats = self.train_step(st.step)
                dt = time.perf_counter() - t0
                st.step += 1
                st.tokens_seen += int(stats["tokens"])
                st.elapsed_s += dt
                st.last = stats
                log.write(json.dumps({"step": st.step, **stats, "tok_s": stats["tokens"] / dt}) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", tail=f"{stats.get('tail_agree', 0):.3f}",
                                tok_s=f"{stats['tokens'] / dt:.0f}")
                if cfg.eval_every and st.step % cfg.eval_every == 0:
                    ev = self.heldout_agreement()
                    log.write(json.dumps({"step": st.step, "tokens_seen": st.tokens_seen, "eval": ev}) + "\n")
                    log.flush()
                    plot_curve(self.run_dir / "log.jsonl", self.run_dir / "curve.png", cfg.name)
                if st.step % cfg.checkpoint_every == 0 or st.step == end:
                    self.save()
        finally:
            log.close()
            bar.close()
        return st

    def _open_log(self) -> IO[str]:
        """``log.jsonl`` for appending, without the lines of steps after the checkpoint being resumed (an
        interrupted run logged them, the resumed run redoes them)."""
        path = self.run_dir / "log.jsonl"
        if path.is_file():
            keep = []
            for line in path.read_text().splitlines():
                try:
                    if int(json.loads(line)["step"]) <= self.state.step:
                        keep.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # torn by a kill
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(keep))
            tmp.replace(path)
        return path.open("a")

    def heldout_agreement(self) -> dict[str, float]:
        recs = self.heldout[: self.cfg.eval_records]
        if not recs:
            return {}
        res = teacher_forced(self.student, recs, list(range(max(2, self.cfg.tau_min), self.cfg.tau_max + 1)),
                             self.cfg.batch_size, self.cfg.max_len)
        return {str(t): round(v["tail_agreement"], 4) for t, v in res.items()}

    def save(self) -> Path:
        st = self.state
        trainable = {n: p.detach().cpu().clone() for n, p in self.params.items()}
        return save_checkpoint(self.run_dir, {
            "step": st.step, "config": self.cfg.model_dump(), "trainable": trainable,
            "optimizer": self.opt.state_dict(), "corpus_hash": self.corpus.content_hash,
            "base_fingerprint": self.fingerprint,
            "cache_hash": self.cache.content_hash if self.cache is not None else None,
            "tokens_seen": st.tokens_seen, "elapsed_s": st.elapsed_s,
            "last": st.last,
        }, self.cfg.keep_checkpoints)
