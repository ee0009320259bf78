"""Where the variants that ship with the platform live."""

from pathlib import Path

SHIPPED_VARIANTS = Path(__file__).resolve().parent / "shipped"
