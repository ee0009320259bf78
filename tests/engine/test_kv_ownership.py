"""One owner for a sequence's KV facts: only the KV cache manager writes them (the scheduler asks it, the runner
reads them), so the paged cache's bookkeeping has one place to change."""

from __future__ import annotations

import ast
from pathlib import Path

import dmtd

KV_FACTS = {"kv_row", "num_prefilled", "prefill_end", "num_cached_tokens", "prefix_keys", "num_think_cached",
            "num_tail_cached", "resume_len"}
OWNER = Path(dmtd.__file__).parent / "engine" / "kv_manager.py"


def _writes(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr in KV_FACTS:
                    out.append(f"{path.name}:{node.lineno} .{el.attr}")
    return out


def test_only_the_kv_cache_manager_writes_a_sequences_kv_facts():
    root = Path(dmtd.__file__).parent
    writes = {p: _writes(p) for p in root.rglob("*.py")}
    assert _writes(OWNER), "the manager writes them (the scan sees its assignments)"
    assert [w for p, ws in writes.items() if p != OWNER for w in ws] == []
