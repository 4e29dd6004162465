"""The layering in pyproject.toml ([tool.importlinter]) is real: the tree keeps it, and one upward
import breaks it. Run by `make test` through `lint-imports` too."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this copy of rollstream, not the installed one
    return subprocess.run([str(LINT), "--no-cache", "--config", str(tree / "pyproject.toml")], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=120)


def _copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "rollstream", tmp_path / "rollstream", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract(tmp_path):
    out = _lint(_copy_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def test_an_upward_import_from_the_core_breaks_the_layers(tmp_path):
    tree = _copy_tree(tmp_path)
    with open(tree / "rollstream" / "filtering" / "decision.py", "a") as fh:
        fh.write("\nimport rollstream.app.cli  # noqa: E402,F401\n")
    out = _lint(tree)
    assert out.returncode == 1
    assert "rollstream.filtering is not allowed to import rollstream.app" in out.stdout


def test_a_kafka_client_in_the_core_breaks_the_purity_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    with open(tree / "rollstream" / "schemas" / "validation.py", "a") as fh:
        fh.write("\nimport kafka  # noqa: E402,F401\n")
    out = _lint(tree)
    assert out.returncode == 1
    assert "rollstream.schemas is not allowed to import kafka" in out.stdout
