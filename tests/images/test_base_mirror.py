"""``scripts/build-base-image.sh`` takes its Debian mirror from the machine's apt sources: the deb822 stanza whose
Suites name bookworm itself (not -security, not -updates), else the one-line ``deb`` entry for bookworm."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-base-image.sh"


def mirror(apt_dir: Path) -> str:
    r = subprocess.run(["bash", str(SCRIPT), "--mirror"], env={"APT_DIR": str(apt_dir), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_the_mirror_is_the_apt_source_of_bookworm_itself(tmp_path):
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://a.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://b.invalid/debian\nSuites: bookworm\n\n"
        "Types: deb\n# a comment inside the stanza\nURIs: http://c.invalid/debian\nSuites: bookworm-updates bookworm\n")
    assert mirror(tmp_path) == "http://c.invalid/debian"


def test_one_line_sources_with_options_and_none_at_all(tmp_path):
    assert mirror(tmp_path) == ""  # no source: the build refuses, naming DEBIAN_MIRROR
    (tmp_path / "sources.list").write_text(
        "# deb http://x.invalid/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://d.invalid/debian-security bookworm-security main\n"
        "deb [ signed-by=/k.gpg ] http://e.invalid/debian bookworm main contrib\n")
    assert mirror(tmp_path) == "http://e.invalid/debian"
