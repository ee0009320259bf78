"""Structured outputs on the shipped variant: 20 JSON schemas × 5 prompts, greedy.

Checks that every exact-profile answer parses and validates against its schema and equals the base model's
constrained answer (the ``--variant none`` engine at τ = 1 with the same grammar), and measures the grammar's
forced tokens as a draft source: their accepted share, and the exact profile's speed with them against without
them (same engine, same prompts, each answer once without and once with them, alternating on this machine).

    .venv/bin/python scripts/json_schemas.py [--schemas 20] [--prompts 5] [--max-new-tokens 120]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # noqa: E402
import llguidance  # noqa: E402

from dmtd.engine.config import EngineConfig  # noqa: E402
from dmtd.engine.logits_process import FORCED_SOURCE  # noqa: E402
from dmtd.engine.sequence import SamplingParams  # noqa: E402
from dmtd.variants.build import build_engine, engine_spec  # noqa: E402
from dmtd.variants.paths import SHIPPED_VARIANTS  # noqa: E402

# bounded as a caller of a small model bounds them: unbounded, SmolLM2 at times loops in a string or an integer's
# digits until max_new_tokens cuts the JSON (4 of 100 answers with strings of 24 characters and free integers)
S, N, B = {"type": "string", "maxLength": 12}, {"type": "number"}, {"type": "boolean"}
I = {"type": "integer", "minimum": 0, "maximum": 10**10}


def obj(**props: object) -> dict[str, object]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS: list[tuple[str, dict[str, object]]] = [
    ("a person", obj(name=S, age=I)),
    ("a book", obj(title=S, author=S, year=I)),
    ("a city", obj(name=S, country=S, population=I)),
    ("a product", obj(name=S, price=N, in_stock=B)),
    ("a movie", obj(title=S, director=S, rating=N)),
    ("a pet", obj(name=S, species={"enum": ["cat", "dog", "fish", "bird"]}, age=I)),
    ("a recipe", obj(dish=S, minutes=I, vegetarian=B)),
    ("a car", obj(make=S, model=S, year=I, electric=B)),
    ("a song", obj(title=S, artist=S, seconds=I)),
    ("a planet", obj(name=S, moons=I, has_rings=B)),
    ("a shopping list", obj(items={"type": "array", "items": S, "minItems": 1, "maxItems": 3})),
    ("a meeting", obj(topic=S, day={"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                      hour=I)),
    ("a colour", obj(name=S, hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"})),
    ("a point", obj(x=N, y=N)),
    ("a user account", obj(username=S, email=S, admin=B)),
    ("a country", obj(name=S, capital=S, languages={"type": "array", "items": S, "maxItems": 3})),
    ("a task", obj(title=S, done=B, priority={"enum": ["low", "medium", "high"]})),
    ("an address", obj(street=S, city=S, zip=S)),
    ("a weather report", obj(city=S, celsius=N, sunny=B)),
    ("a team", obj(name=S, members={"type": "array", "items": obj(name=S, role=S), "maxItems": 3})),
]
ASKS = ["Describe {} as JSON.", "Give me {} in JSON.", "Invent {} and answer with JSON only.",
        "Write JSON for {}.", "Reply with {} as a JSON object."]


def timed(engine, chat: list[dict[str, str]], params: SamplingParams) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = engine.generate([chat], params)[0]
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--tau", type=int, default=4)
    ap.add_argument("--first-prompt", type=int, default=0, help="skip the prompts before this one (split a run)")
    ap.add_argument("--no-speed", action="store_true", help="validity and equality only: no pass without forced drafts")
    args = ap.parse_args()
    variant = build_engine(engine_spec(None, "smollm2-135m-dmtd", search_dirs=[SHIPPED_VARIANTS]),
                           EngineConfig(max_num_seqs=1, max_model_len=1024))
    base = build_engine(engine_spec(None, "none"), EngineConfig(max_num_seqs=1, max_model_len=1024))
    cases = [(what, schema, ask.format(what)) for what, schema in SCHEMAS[: args.schemas]
             for ask in ASKS[args.first_prompt: args.prompts]]
    grammars = {what: llguidance.LLMatcher.grammar_from_json_schema(schema) for what, schema in SCHEMAS}
    jobs = [([{"role": "user", "content": ask}], what) for what, _, ask in cases]

    def params(what: str, exact: bool) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.max_new_tokens, tau=args.tau if exact else 1, exact=exact,
                              grammar=grammars[what])

    ref, without, with_forced = [], [], []
    t_without = t_with = 0.0
    for chat, what in jobs:  # one answer after the other, alternating: both see the machine's load alike
        ref.append(timed(base, chat, params(what, False))[0])
        if not args.no_speed:
            variant.cycles.forced_drafts = False
            r, dt = timed(variant, chat, params(what, True))
            without.append(r)
            t_without += dt
        variant.cycles.forced_drafts = True
        r, dt = timed(variant, chat, params(what, True))
        with_forced.append(r)
        t_with += dt
        print(f"{len(ref)}/{len(jobs)}: {r.text!r}", file=sys.stderr, flush=True)
    valid = same = 0
    for (_, schema, _), r, b, w in zip(cases, with_forced, ref, without or with_forced):
        try:
            jsonschema.validate(json.loads(r.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"invalid: {r.text!r} ({e})")
        same += r.token_ids == b.token_ids == w.token_ids
    forced = variant.cycles.ledger.seen.get(FORCED_SOURCE, ([], []))
    tokens = sum(len(r.token_ids) for r in with_forced)
    print(json.dumps({
        "answers": len(cases), "valid": valid, "equal_to_base_constrained": same, "tokens": tokens,
        "forced_drafted": sum(forced[0]), "forced_accepted": sum(forced[1]),
        "drafted_with": sum(r.num_drafted for r in with_forced),
        "accepted_with": sum(r.num_accepted for r in with_forced),
        "drafted_without": sum(r.num_drafted for r in without),
        "accepted_without": sum(r.num_accepted for r in without),
        "tok_s_with_forced": round(tokens / t_with, 2),
        "tok_s_without": round(tokens / t_without, 2) if without else None,
        "speedup": round(t_without / t_with, 3) if without else None}, indent=1))


if __name__ == "__main__":
    main()
