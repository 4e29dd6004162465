"""docs/architecture.md names every module of rollstream/, and only modules that exist: a row of
its module table starts with `dir/first.py` and may list more files of that folder after it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def named_modules(page: str) -> set[str]:
    """The module paths (relative to rollstream/) the first cells of the page's table rows name."""
    named = set()
    for line in page.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                folder = name.rpartition("/")[0] + "/"
                name = name.rpartition("/")[2]
            named.add(folder + name)
    return named


def test_the_architecture_page_names_every_module():
    modules = {str(p.relative_to(ROOT / "rollstream")) for p in (ROOT / "rollstream").rglob("*.py")
               if p.name != "__init__.py"}
    named = named_modules((ROOT / "docs" / "architecture.md").read_text())
    assert sorted(modules - named) == [], "modules the page leaves out"
    assert sorted(named - modules) == [], "names on the page that are no module"


def test_the_parse_reads_a_folder_once_per_row():
    row = "| `kafka/a.py`, `b.py`, `trainer/c.py`, `d.py` | text with `not/a.py` |"
    assert named_modules(row) == {"kafka/a.py", "kafka/b.py", "trainer/c.py", "trainer/d.py"}
