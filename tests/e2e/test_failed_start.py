"""`rollstream run` against a broker that never answers, twice, with a previous run in its
folder: the previous run stays whole, the failed starts leave only their logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollstream.app.run_folder import is_run

from ..app.test_run_folder import previous_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_run_against_an_unreachable_broker_keeps_the_previous_run(tmp_path):
    config = yaml.safe_load((ROOT / "examples" / "rlvr_math.yaml").read_text())
    config.update(name="mine", kafka={"bootstrap_servers": "127.0.0.1:1"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    previous_run(tmp_path / "runs" / "mine")
    for attempt in (1, 2):
        run = subprocess.run([sys.executable, "-m", "rollstream", "run", "-c", "config.yaml", "--replace"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 2, (attempt, run.stdout[-2000:], run.stderr[-2000:])
        out = " ".join((run.stdout + run.stderr).split())
        assert "no Kafka broker answers at '127.0.0.1:1'" in out and "kafka.bootstrap_servers" in out, out[-2000:]
        # the failed start is in runs/mine (its logs), not a run; the previous run is whole
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mine", "mine.20261201-101500"], attempt
        assert not is_run(tmp_path / "runs" / "mine")
        kept = tmp_path / "runs" / "mine.20261201-101500"
        assert json.loads((kept / "summary.json").read_text()) == {"outcome": "complete"}
