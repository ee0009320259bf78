"""The docs stand alone: every link and file citation in README.md, docs/, code and tests resolves inside
the repository, "docs/design.md §N" names a section that exists, and README links every docs page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
TEXT_DIRS = ("platform", "operator", "contract", "tests", "scripts", "docker", "helm", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".proto", ".Dockerfile", ".tpl", ".txt", ".json"}
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"(?<![\w/.-])((?:docs|platform|operator|contract|tests|scripts|docker|helm|proto)/[\w./-]*\w)")
CITATION = re.compile(r"([\w./-]*design\.md) §(\d+)")


def texts() -> dict[Path, str]:
    files = [ROOT / "README.md", ROOT / "Makefile", *DOCS]
    for d in TEXT_DIRS:
        files += [p for p in (ROOT / d).rglob("*") if p.is_file() and (p.suffix in SUFFIXES or p.name.endswith(
            "Dockerfile")) and "__pycache__" not in p.parts and "v1" not in p.relative_to(ROOT).parts[:3]]
    return {p: p.read_text(errors="replace") for p in files}


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def test_no_path_reaches_outside_the_repository() -> None:
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, t in texts().items()
           for m in re.finditer(r"(?<![\w.])\.\./[\w./-]+", t)
           if not inside(p.parent / m.group(0))]
    assert bad == []
    assert [p for p, t in texts().items() if "shared/" + "design.md" in t] == []


def test_markdown_links_resolve_in_the_repository() -> None:
    bad = []
    for p in [ROOT / "README.md", *DOCS]:
        for target in MD_LINK.findall(p.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # web addresses and anchors
            path = (p.parent / target.split("#")[0]).resolve()
            if not inside(path) or not path.exists():
                bad.append(f"{p.relative_to(ROOT)}: {target}")
    assert bad == []


def test_cited_repository_files_exist() -> None:
    bad = []
    for p, t in texts().items():
        for m in DOC_PATH.finditer(t):
            cited = m.group(1).rstrip(".")
            if any(ch in cited for ch in "*{}<>$") or cited.endswith("/"):
                continue
            if cited.endswith((".md", ".py", ".sh", ".yaml", ".toml", ".proto", "Dockerfile")) and \
                    not (ROOT / cited).exists():
                bad.append(f"{p.relative_to(ROOT)}: {cited}")
    assert bad == []


def test_design_citations_name_existing_sections() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, flags=re.M))
    cites = [(p, m.group(1), m.group(2)) for p, t in texts().items() for m in CITATION.finditer(t)]
    assert cites, "the code cites docs/design.md"
    assert [f"{p.relative_to(ROOT)}: {f} §{n}" for p, f, n in cites
            if f != "docs/design.md" or n not in sections] == []


def test_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    linked = set(MD_LINK.findall(readme))
    assert [d.name for d in DOCS if f"docs/{d.name}" not in linked] == []
    for page in ("serving", "training", "operations", "registry", "benchmarks", "cost"):
        assert f"docs/{page}.md" in linked
