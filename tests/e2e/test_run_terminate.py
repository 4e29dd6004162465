"""`rollstream run` stopped by SIGTERM (a supervisor, a scheduler, `kill`) leaves nothing behind:
every stage process and the embedded broker's JVM are stopped before it exits with 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STAGES = {"admission", "aggregator", "generation", "reward"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


def broker_pids(kafka_dir: Path) -> list[int]:
    """The JVMs whose command line names ``kafka_dir`` (the run's embedded broker)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "kafka.Kafka" in cmdline and str(kafka_dir) in cmdline and alive(int(proc.name)):
                pids.append(int(proc.name))
    return pids


def test_sigterm_stops_every_stage_and_the_broker(tmp_path):
    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "rlvr_math.yaml").read_text())
    config.update(name="terminate", max_steps=50, time_limit_s=600, kafka={"bootstrap_servers": None})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.Popen([sys.executable, "-m", "rollstream", "run", "-c", "config.yaml"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run_dir = tmp_path / "runs" / "terminate"
    stages: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 300
        while not (set(stages) == STAGES and broker_pids(run_dir / "kafka")):
            assert run.poll() is None, run.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"stages up: {sorted(stages)}"
            pid_file = run_dir / "stages.json"
            if pid_file.exists():
                try:
                    stages = json.loads(pid_file.read_text())
                except json.JSONDecodeError:  # being rewritten
                    pass
            time.sleep(0.5)  # polling the files for the state to reach; nothing is asserted on time
        broker = broker_pids(run_dir / "kafka")
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
        assert [name for name, pid in stages.items() if alive(pid)] == []
        assert [pid for pid in broker if alive(pid)] == [] and broker_pids(run_dir / "kafka") == []
    finally:
        if run.poll() is None:
            run.kill()
        for pid in [*stages.values(), *broker_pids(run_dir / "kafka")]:  # a failed run's leftovers
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
