"""The documentation holds together: the site builds in strict mode (every link between pages and
every anchor resolves), the README stays a front door, and the code cites only documents that
exist in the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def test_the_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    out = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "byo" / "index.html").exists()


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == set(re.findall(r"([\w/-]+\.md)$", nav, re.MULTILINE))


def test_the_readme_is_a_front_door_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert targets, "the README links to the docs"
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_the_code_cites_only_documents_in_the_repository():
    cited = {}
    for path in [*(ROOT / "rollstream").rglob("*.py"), *(ROOT / "rollstream").rglob("*.avsc")]:
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            cited.setdefault(name, path.relative_to(ROOT))
    missing = {name: str(where) for name, where in cited.items()
               if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists()}
    assert missing == {}


def test_the_code_names_no_outside_notes():
    """Design notes, issue numbers and scenario lists live outside the repository; a reader of the
    code cannot follow them."""
    pattern = re.compile(r"peer[ _-]scenario|stack[ _-]notes|reference-behaviou?r|\bissue \d+", re.IGNORECASE)
    hits = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in (ROOT / "rollstream").rglob("*")
            if path.suffix in (".py", ".avsc", ".json") for m in pattern.finditer(path.read_text())]
    assert hits == []
