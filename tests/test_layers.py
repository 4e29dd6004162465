"""The layering in pyproject.toml ([tool.importlinter]) is real: the tree keeps it, and one upward
import breaks it. Run by `make test` through `lint-imports` too."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "Contracts: 6 kept, 0 broken." in out.stdout


@pytest.mark.parametrize("module, line, broken", [
    # an upward import from the core breaks the layers
    ("filtering/decision.py", "import rollstream.app.cli", "rollstream.filtering is not allowed to import rollstream.app"),
    # a Kafka client in the core breaks the purity contract
    ("schemas/validation.py", "import kafka", "rollstream.schemas is not allowed to import kafka"),
    # Kafka I/O in the trainer's maths
    ("trainer/grpo.py", "import rollstream.kafka.event_worker", "rollstream.trainer.grpo is not allowed to import rollstream.kafka"),
    # the metrics of every worker reaching the filters' core (and through it torch)
    ("observability/metrics.py", "import rollstream.filtering.prompt_state",
     "rollstream.observability is not allowed to import rollstream.filtering"),
    # the library API reaching into the command line
    ("client.py", "import rollstream.app.producer", "rollstream.client is not allowed to import rollstream.app"),
])
def test_one_forbidden_import_breaks_a_contract(tmp_path, module, line, broken):
    tree = _copy_tree(tmp_path)
    with open(tree / "rollstream" / module, "a") as fh:
        fh.write(f"\n{line}  # noqa: E402,F401\n")
    out = _lint(tree)
    assert out.returncode == 1
    assert broken in out.stdout

