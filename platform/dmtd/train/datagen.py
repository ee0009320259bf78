"""``dmtd data``: complete prompts with the base model through our engine, shard by shard, resumably."""

from __future__ import annotations

import json
import lzma
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dmtd.engine.llm import LLMEngine
from dmtd.engine.sequence import SamplingParams
from dmtd.train.corpus import (
    CORPUS_MANIFEST,
    CorpusConfig,
    CorpusError,
    CorpusManifest,
    PlannedRecord,
    Record,
    ShardInfo,
    plan_records,
    read_manifest,
    sha256_bytes,
    shard_name,
    write_atomic,
    write_manifest,
)

Prompt = str | list[dict[str, str]] | list[int]


def load_user_prompts(path: Path) -> list[Prompt]:
    """Prompts from a user file: ``.txt`` (one per line) or ``.jsonl`` (``{"prompt": ..}`` / ``{"messages": [..]}``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CorpusError(f"prompt file {str(path)!r} not found")
    out: list[Prompt] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append(line.strip().replace("\\n", "\n"))
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{n}: not valid JSON ({e})") from e
        if isinstance(d, dict) and isinstance(d.get("prompt"), str) and d["prompt"]:
            out.append(d["prompt"])
        elif isinstance(d, dict) and isinstance(d.get("messages"), list) and d["messages"] and all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in d["messages"]):
            out.append([{"role": str(m["role"]), "content": str(m["content"])} for m in d["messages"]])
        else:
            raise CorpusError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [{{role, content}}]}}")
    if not out:
        raise CorpusError(f"prompt file {str(path)!r} holds no prompts")
    return out


def render_prompt(engine: LLMEngine, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a user turn (or message list) through the chat template when there is one."""
    tok = engine.tokenizer
    has_template = tok is not None and getattr(tok, "chat_template", None)
    if prompt and isinstance(prompt, list) and isinstance(prompt[0], int):
        return engine.encode(prompt)
    if isinstance(prompt, str):
        return engine.encode([{"role": "user", "content": prompt}] if has_template else prompt)
    if not has_template:
        return engine.encode("\n".join(m["content"] for m in prompt if isinstance(m, dict)))
    return engine.encode(prompt)


def _open_or_create(out: Path, cfg: CorpusConfig, num_planned: int) -> CorpusManifest:
    if (out / CORPUS_MANIFEST).is_file():
        m = read_manifest(out)
        if m.config.model_dump(exclude={"limit"}) != cfg.model_dump(exclude={"limit"}):
            diff = [k for k, v in cfg.model_dump().items() if m.config.model_dump().get(k) != v]
            raise CorpusError(f"{out} already holds a corpus made with a different config ({', '.join(diff)}); "
                              "use a new --out or the same settings to resume")
        for s in m.shards:
            path = out / s.name
            if not path.is_file() or sha256_bytes(path.read_bytes()) != s.sha256:
                raise CorpusError(f"corpus {str(out)!r}: shard {s.name} is missing or corrupted; "
                                  "delete the corpus directory and start again")
        m.config, m.num_planned_records, m.complete = cfg, num_planned, len(m.shards) * cfg.shard_size >= num_planned
        return m
    if out.exists() and any(out.iterdir()):
        raise CorpusError(f"{out} exists, is not empty and holds no {CORPUS_MANIFEST}")
    out.mkdir(parents=True, exist_ok=True)
    m = CorpusManifest(config=cfg, num_planned_records=num_planned)
    write_manifest(out, m)
    return m


MIRROR_SUFFIX = ".xz"


def _open_mirror(mirror: Path, cfg: CorpusConfig) -> CorpusManifest | None:
    """The manifest of a mirror (xz-compressed shards of the same corpus), None when it is still empty."""
    if not (mirror / CORPUS_MANIFEST).is_file():
        if mirror.exists() and not mirror.is_dir():
            raise CorpusError(f"mirror {str(mirror)!r} is not a directory")
        return None
    m = read_manifest(mirror)
    if m.config.model_dump(exclude={"limit"}) != cfg.model_dump(exclude={"limit"}):
        diff = [k for k, v in cfg.model_dump(exclude={"limit"}).items() if m.config.model_dump().get(k) != v]
        raise CorpusError(f"mirror {str(mirror)!r} holds a corpus made with a different config ({', '.join(diff)})")
    return m


def _from_mirror(mirror: Path, mm: CorpusManifest | None, k: int) -> tuple[bytes, ShardInfo] | None:
    """Shard ``k`` restored from the mirror, checked against the hash its manifest records."""
    if mm is None or k >= len(mm.shards):
        return None
    info = mm.shards[k]
    path = mirror / (info.name + MIRROR_SUFFIX)
    try:
        data = lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise CorpusError(f"mirror shard {str(path)!r} cannot be read ({e})") from e
    if sha256_bytes(data) != info.sha256:
        raise CorpusError(f"mirror shard {str(path)!r} does not match its SHA-256 in the mirror's manifest")
    return data, info


def _to_mirror(mirror: Path, m: CorpusManifest, data: bytes, k: int) -> None:
    """Add shard ``k`` of ``m`` (its bytes ``data``) to the mirror; its manifest then lists shards 0..k."""
    mirror.mkdir(parents=True, exist_ok=True)
    info = m.shards[k]
    write_atomic(mirror / (info.name + MIRROR_SUFFIX), lzma.compress(data, preset=9))
    write_manifest(mirror, m.model_copy(update={"complete": False, "shards": m.shards[: k + 1]}))


def _backfill_mirror(out: Path, mirror: Path, mm: CorpusManifest | None, m: CorpusManifest) -> None:
    """Shards the corpus made before it had a mirror go into the mirror too."""
    for k in range(len(mm.shards) if mm is not None else 0, len(m.shards)):
        _to_mirror(mirror, m, (out / m.shards[k].name).read_bytes(), k)


def make_corpus(out: Path, engine: LLMEngine, prompts: list[Prompt], cfg: CorpusConfig,
                progress: bool = True, on_shard: Callable[[int], Any] | None = None,
                mirror: Path | None = None) -> CorpusManifest:
    """Generate (or resume) the corpus described by ``cfg`` into ``out``; returns the final manifest.

    ``on_shard(k)`` is called after shard ``k`` is durably written (tests use it to interrupt). With
    ``mirror`` (a directory of xz-compressed shards and a manifest, small enough for a repository), shards
    the mirror holds are restored from it instead of generated, after their hash is checked, and every newly
    generated shard is added to it: the same command rebuilds a corpus on a new machine in seconds.
    """
    if len(prompts) != cfg.num_prompts:
        raise CorpusError(f"config says {cfg.num_prompts} prompts, got {len(prompts)}")
    plan = plan_records(cfg)
    m = _open_or_create(Path(out), cfg, len(plan))
    chunks = [plan[i: i + cfg.shard_size] for i in range(0, len(plan), cfg.shard_size)]
    done = sum(s.num_records for s in m.shards)
    bar = tqdm(total=len(plan), initial=done, unit="seq", desc="dmtd data", disable=not progress,
               dynamic_ncols=True)
    n_tok, t0 = 0, time.perf_counter()
    mm = _open_mirror(Path(mirror), cfg) if mirror is not None else None
    if mirror is not None:
        _backfill_mirror(Path(out), Path(mirror), mm, m)
    for k in range(len(m.shards), len(chunks)):
        restored = _from_mirror(Path(mirror), mm, k) if mirror is not None else None
        if restored is not None:
            data, info = restored
            write_atomic(Path(out) / shard_name(k), data)
            m.shards.append(info)
            write_manifest(Path(out), m)
            bar.update(info.num_records)
            bar.set_postfix(tokens=m.num_tokens, restored=k + 1)
            if on_shard is not None:
                on_shard(k)
            continue
        records = _complete(engine, prompts, chunks[k], cfg)
        data = "".join(r.to_json() + "\n" for r in records).encode()
        write_atomic(Path(out) / shard_name(k), data)
        m.shards.append(ShardInfo(name=shard_name(k), sha256=sha256_bytes(data), num_records=len(records),
                                  num_tokens=sum(r.num_tokens for r in records)))
        write_manifest(Path(out), m)
        if mirror is not None:
            _to_mirror(Path(mirror), m, data, k)
        n_tok += sum(len(r.completion_ids) for r in records)
        bar.update(len(records))
        bar.set_postfix(tokens=m.num_tokens, gen_tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
        if on_shard is not None:
            on_shard(k)
    bar.close()
    m.complete = True
    write_manifest(Path(out), m)
    return m


def _complete(engine: LLMEngine, prompts: list[Prompt], chunk: list[PlannedRecord],
              cfg: CorpusConfig) -> list[Record]:
    ids = [render_prompt(engine, prompts[r.prompt_idx]) for r in chunk]
    params = [SamplingParams(temperature=r.temperature, top_p=cfg.top_p if r.temperature > 0 else 1.0,
                             seed=r.seed, max_new_tokens=cfg.max_new_tokens) for r in chunk]
    results = engine.generate(ids, params)
    out = []
    for r, p_ids, res in zip(chunk, ids, results):
        if res.error:
            raise CorpusError(f"generation failed for prompt {r.prompt_idx}: {res.error}")
        out.append(Record(r.idx, r.prompt_idx, r.split, r.temperature, r.seed, p_ids, res.token_ids,
                          res.finish_reason or "length"))
    return out
