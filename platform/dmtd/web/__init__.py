"""The built-in web dashboard: static assets (plain HTML, JS and canvas; nothing from a CDN) that the
gateway serves at ``/dashboard``, polling ``/dashboard/stats``."""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
ASSETS = ("dashboard.html", "dashboard.js", "dashboard.css")


def asset_path(name: str) -> Path | None:
    """The file of a known asset (None for anything else: no path traversal)."""
    return STATIC / name if name in ASSETS and (STATIC / name).is_file() else None
