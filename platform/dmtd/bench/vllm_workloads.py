"""The workloads ``dmtd bench serve --against vllm`` runs on each server, as ``vllm bench serve`` command lines.

* ``chat``: the eight chat prompts of the exact benchmarks (none in a training corpus; vLLM's custom dataset, sent as
  the user turn) at each ``--concurrency``;
* ``prefix``: vLLM's ``prefix_repetition`` dataset, 4 prefixes × 1,024 tokens + a 64-token suffix, 32 requests at
  concurrency 4: the first request of each prefix computes it, the others read it from the cache;
* ``two-turn``: 32 two-turn conversations at concurrency 8. The first turns run first; each server's own answers
  (greedy, from the saved result) then go into the second turns' history, so a server that keeps a conversation's
  KV answers the second turn from its cache. The conversations are rendered with the model's chat template and sent
  to ``/v1/completions`` (vLLM's client sends one user message to the chat endpoint, no history); the row reports
  the second turns, whose TTFT is the figure the workload is for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dmtd.bench.exact_bench import CHATS

CHAT_PROMPTS = tuple(CHATS)  # the exact benchmarks' chats: none is in a training corpus
PREFIX = {"prefixes": 4, "prefix_len": 1024, "suffix_len": 64, "concurrency": 4, "requests": 32}
TWO_TURN = {"conversations": 32, "concurrency": 8}
# the second turns, in turn: each asks about the first answer, so the answer is context the server needs
FOLLOW_UPS = ("Now say that again in one short sentence.", "Give me one more example of that.",
              "Why is that? Explain the first point briefly.", "Can you make that simpler for a child?")
VALIDATION_CHATS = Path(__file__).resolve().parents[3] / "corpora" / "short-chats-val.txt"

Render = Callable[[list[dict[str, str]]], str]  # chat messages → the prompt text, generation prompt appended


def first_turns(n: int, extra: Path = VALIDATION_CHATS) -> list[str]:
    """``n`` distinct first messages: the eight chats, then the 24 validation chats (neither in a training corpus)."""
    pool = list(CHAT_PROMPTS) + [line.strip() for line in extra.read_text().splitlines() if line.strip()]
    if len(set(pool)) < n:
        raise ValueError(f"two-turn conversations: {n} asked for, {len(set(pool))} distinct first messages")
    return list(dict.fromkeys(pool))[:n]


def conversation(first: str, answer: str | None, i: int) -> list[dict[str, str]]:
    """Conversation ``i``'s messages: its first turn, or (given the first answer) both turns."""
    msgs = [{"role": "user", "content": first}]
    if answer is not None:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
    return msgs


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    """A custom dataset for ``vllm bench serve``: one ``{"prompt": ...}`` a line, sent in this order."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def write_dataset(path: Path) -> Path:
    return write_prompts(path, CHAT_PROMPTS)


def two_turn_prompts(firsts: Sequence[str], answers: Sequence[str] | None, render: Render) -> list[str]:
    """The rendered prompts of every conversation's first turn (``answers`` None) or second turn (the first turns'
    answers, in order, in its history)."""
    if answers is not None and len(answers) != len(firsts):
        raise ValueError(f"two-turn conversations: {len(answers)} first answers for {len(firsts)} conversations")
    return [render(conversation(f, None if answers is None else answers[i], i)) for i, f in enumerate(firsts)]


def chat_template(tokenizer_dir: str) -> Render:
    """The model's own chat template (its tokenizer's), as both servers apply it to a chat request."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return lambda msgs: str(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def workloads(concurrency: list[int], requests_per_worker: int, max_new: int, dataset: Path,
              prefix: bool = True, two_turn: bool = True) -> list[dict[str, Any]]:
    """What ``vllm bench serve`` runs against each side: name, concurrency, request count, dataset options (a
    two-turn workload's dataset is written per side, from that side's first answers: ``turn_args``)."""
    out = [{"workload": "chat", "concurrency": n, "num_prompts": max(n * requests_per_worker, len(CHAT_PROMPTS)),
            "dataset_args": ["--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
                             "--custom-output-len", str(max_new)]} for n in concurrency]
    if prefix:
        p = PREFIX
        out.append({"workload": "prefix", "concurrency": p["concurrency"], "num_prompts": p["requests"],
                    "dataset_args": ["--dataset-name", "prefix_repetition",
                                     "--prefix-repetition-prefix-len", str(p["prefix_len"]),
                                     "--prefix-repetition-suffix-len", str(p["suffix_len"]),
                                     "--prefix-repetition-num-prefixes", str(p["prefixes"]),
                                     "--prefix-repetition-output-len", str(max_new)]})
    if two_turn:
        out.append({"workload": "two-turn", "concurrency": TWO_TURN["concurrency"],
                    "num_prompts": TWO_TURN["conversations"], "max_new_tokens": max_new})
    return out


def turn_args(prompts: Path, max_new: int) -> list[str]:
    """One turn of the two-turn workload: rendered prompts, in the file's order, to the completions endpoint."""
    return ["--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template", "--disable-shuffle",
            "--custom-output-len", str(max_new)]


def client_command(venv: Path, base_url: str, model: str, tokenizer: str, w: dict[str, Any], result: Path,
                   seed: int = 0, warmups: int = 1) -> list[str]:
    """``vllm bench serve`` for one workload on one side (greedy; ``warmups`` requests first). A workload with
    ``completions`` set (a two-turn turn) goes to ``/v1/completions``, the others to the chat endpoint."""
    backend, endpoint = ("openai", "/v1/completions") if w.get("completions") else \
        ("openai-chat", "/v1/chat/completions")
    return [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", backend, "--base-url", base_url,
            "--endpoint", endpoint, "--model", model, "--tokenizer", tokenizer,
            *w["dataset_args"], "--num-prompts", str(w["num_prompts"]), "--max-concurrency", str(w["concurrency"]),
            "--request-rate", "inf", "--temperature", "0", "--seed", str(seed), "--num-warmups", str(warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]
