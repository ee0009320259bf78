"""One owner for a sequence's draft state: the verified-cycles component (dmtd.engine.verified, with its ledger in
dmtd.engine.draft_sources) changes a ``Sequence.draft``; the scheduler and the request processor only read it, and the
runner's draft pass only keeps its index of the context's ids there."""

from __future__ import annotations

import ast
from pathlib import Path

import dmtd

ENGINE = Path(dmtd.__file__).parent / "engine"
OWNERS = {ENGINE / "verified.py", ENGINE / "draft_sources.py"}
# the draft pass's index of context ids outside the draft vocabulary (verified_passes._draft_logits)
RUNNER_INDEX = {"context_vocab", "context_vocab_seen"}
MUTATORS = {"add", "trim", "clear", "append", "update"}


def _changes(path: Path) -> list[tuple[str, str]]:
    """(where, what) for each change of a draft state: an assignment to its attributes or a mutating call, through
    ``<x>.draft`` or a local name bound to it."""
    tree = ast.parse(path.read_text())
    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute)
               and n.value.attr == "draft" for t in n.targets if isinstance(t, ast.Name)}

    def is_draft(node: ast.expr) -> bool:
        while isinstance(node, ast.Attribute):
            if node.attr == "draft":
                return True
            node = node.value
        return isinstance(node, ast.Name) and node.id in aliases

    def attr_of(node: ast.expr) -> str:  # the draft state's attribute a change is to (s.draft.q.append → q)
        while isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in aliases
                                                       or isinstance(node.value, ast.Attribute)
                                                       and node.value.attr == "draft"):
            node = node.value
        return node.attr if isinstance(node, ast.Attribute) else "?"

    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [el for t in node.targets for el in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and is_draft(node.func.value)):
            inner = node.func.value
            out.append((f"{path.name}:{node.lineno}", node.func.attr if isinstance(inner, ast.Name)
                        or (isinstance(inner, ast.Attribute) and inner.attr == "draft") else attr_of(inner)))
        out += [(f"{path.name}:{node.lineno}", attr_of(t)) for t in targets
                if isinstance(t, ast.Attribute) and is_draft(t.value)]
    return out


def test_only_the_verified_cycles_component_changes_a_sequences_drafts():
    root = Path(dmtd.__file__).parent
    changes = {p: _changes(p) for p in root.rglob("*.py")}
    assert all(changes[p] for p in OWNERS), "the component changes them (the scan sees its writes)"
    others = [(where, what) for p, cs in changes.items() if p not in OWNERS for where, what in cs]
    assert [w for w in others if w[1] not in RUNNER_INDEX] == []
    assert {w[0].split(":")[0] for w in others} == {"verified_passes.py"}  # the draft pass's index, nothing else
