"""Where a benchmark's ``--json`` result goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """``result`` as indented JSON at ``path`` (its folders made), said on stdout."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2))
    print(f"wrote {p}")
    return p
