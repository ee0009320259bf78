"""Run inside an image (stdlib only): import every module its entry point can reach.

From the entry modules, follow every import of our packages (``OURS``) transitively, function-level
imports included, and import each module found, ours and third-party. Function-level imports count: the
operator once imported the registry client only inside a method, so an image without it passed every
import-time check and failed at the first publish. Prints one JSON
object: the modules found, the ones that failed to import with their error, and forbidden modules loaded.
Usage: python3 import_check.py ENTRY_MODULE [ENTRY_MODULE ...] [--forbid NAME ...]
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import json
import sys

OURS = ("dmtd", "dmtd_operator", "dmtd_contract")


def ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def find(module: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def imported_by(module: str) -> set[str]:
    spec = find(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return set()
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    is_pkg = spec.submodule_search_locations is not None
    base = module if is_pkg else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{root}.{node.module}" if node.module else root
            else:
                target = node.module or ""
            found.add(target)
            for a in node.names:  # `from pkg import submodule`
                if a.name != "*" and find(target) is not None and find(f"{target}.{a.name}") is not None:
                    found.add(f"{target}.{a.name}")
    return found


def main(argv: list[str]) -> int:
    forbid = argv[argv.index("--forbid") + 1:] if "--forbid" in argv else []
    entries = argv[: argv.index("--forbid")] if "--forbid" in argv else argv
    wanted: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        for parent in range(1, name.count(".") + 1):  # importing a.b.c runs a and a.b too
            todo.append(name.rsplit(".", parent)[0])
        if ours(name) or name in entries:
            todo.extend(imported_by(name) - wanted)
    failed: dict[str, str] = {}
    for name in sorted(wanted):
        if name == "__future__":
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 — every failure is a finding
            failed[name] = f"{type(e).__name__}: {e}"
    loaded = sorted(f for f in forbid if f in sys.modules)
    print(json.dumps({"modules": sorted(wanted), "failed": failed, "forbidden_loaded": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
