"""Fault experiments: a run with one fault injected mid-run, judged by its outcome and by
``rollstream audit`` (rollstream.tools.audit).

Two kinds of run:

* ``synthetic_run``: the RLVR stream processors and the trainer as supervised stage processes
  (admission, aggregator, ``rollstream worker trainer`` without a model), the generation and
  reward half played by the integration tests' synthetic rollout source. The model is not the
  point here, so every outcome is exact: 24 prompts, every group accepted, 6 batches of 4.
* ``pipeline_run``: the real pipeline, ``rollstream run`` on a small config (the bundled model
  on CPU), for faults of the generation, reward, group-queue and env stages.

A fault is one of ``FAULTS``: SIGKILL a stage process (the supervisor restarts it), stop and
restart the broker, or SIGKILL one node of a 3-broker cluster (replication 3, min in-sync 2) and
bring it back. Expected for every fault: the run completes, the audit passes (nothing accepted
lost or trained twice) and no dead letter exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from rollstream.app.processes import StageProcesses
from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.kafka.admin import create_pipeline_topics
from rollstream.kafka.broker import EmbeddedBroker, EmbeddedCluster
from rollstream.kafka.topics import Topics
from rollstream.tools.audit import run_audit
from rollstream.kafka.readback import count_records
from tests.integration.harness import SyntheticRollout, produce, prompt

REPO = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, BATCH = 24, 4, 4
STAGE_FAULTS = ("admission", "aggregator", "trainer")  # synthetic run: SIGKILL one of these processes
BROKER_FAULTS = ("broker", "cluster-node")
PIPELINE_FAULTS = ("generation", "reward", "aggregator", "group-queue", "env")
FAULTS = (*(f"kill:{s}" for s in STAGE_FAULTS), *BROKER_FAULTS, *(f"pipeline:{s}" for s in PIPELINE_FAULTS))


@dataclass
class FaultResult:
    fault: str
    outcome: str  # complete | end_of_data | ... (the run's), or "error"
    audit_ok: bool
    failed_checks: list[str]
    counts: dict
    dead_letters: dict
    stage_restarts: dict
    fault_at_s: float | None  # when the fault was injected, seconds after the run started
    seconds: float
    detail: str = ""
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = self.outcome in ("complete", "end_of_data") and self.audit_ok and not self.dead_letters

    def to_json(self) -> dict:
        return asdict(self)


def slow_first_sample_passes(delay_s: float) -> Callable:
    """Rewards [1, 0, 0, 0] (every group accepted), each request answered after ``delay_s``."""
    def script(prompt_id: str, index: int, round_: int):
        if index == 0:
            time.sleep(delay_s)
        return float(index == 0), "stop"
    return script


def synthetic_config(path: Path, prefix: str, name: str, **kafka) -> Path:
    config = {
        "name": name, "kafka": {"topic_prefix": prefix, "partitions": 2, **kafka},
        "rollout_batch_size": BATCH, "num_return_sequences_in_group": GROUP, "max_running_prompts": 2,
        "max_prompts_per_batch": 64, "max_steps": PROMPTS // BATCH + 2, "prompt_timeout_s": 30,
        "max_stage_restarts": 5, "stage_restart_backoff_s": 0.5, "actor_train": {"enabled": False},
        "rewards": {"synth": {"reward_type": "gsm8k",
                              "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def synthetic_run(workdir: Path, fault: str, bootstrap=None, timeout_s: float = 420.0) -> FaultResult:
    """One synthetic RLVR run on ``bootstrap`` (a broker of its own when the fault is a broker's)
    with ``fault`` injected once the first group is accepted."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    broker = cluster = None
    kafka = {}
    if fault == "broker":
        broker = EmbeddedBroker(workdir / "kafka")
        bootstrap = broker.start(timeout=120)
    elif fault == "cluster-node":
        cluster = EmbeddedCluster(workdir / "cluster", brokers=3)
        bootstrap = cluster.start(timeout=240)
        kafka = {"replication_factor": 3, "min_insync_replicas": 2}
    name = f"chaos-{fault.replace(':', '-')}-{uuid.uuid4().hex[:6]}"
    topics = Topics(f"{name}.")
    config_path = synthetic_config(workdir / "config.yaml", topics.prefix, name, **kafka)
    config = load_config(config_path)
    create_pipeline_topics(bootstrap, config.kafka)
    stages = StageProcesses(config_path, bootstrap, workdir / "logs", max_restarts=config.max_stage_restarts,
                            backoff_s=config.stage_restart_backoff_s, cwd=workdir)
    (workdir / "logs").mkdir(exist_ok=True)
    rollout = SyntheticRollout(bootstrap, topics, slow_first_sample_passes(0.5))
    fault_at = None
    outcome, detail = "error", ""
    try:
        for stage in (Stage.admission, Stage.aggregator, Stage.trainer):
            stages.start(stage)
        rollout.start()
        produce(bootstrap, topics.prompts, "Prompt", [prompt(f"p{i:02d}") for i in range(PROMPTS)])
        from tests.integration.test_end_of_data import end_data
        end_data(bootstrap, topics, PROMPTS)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stages.check(finished=frozenset({"trainer"}))
            trainer = stages.procs["trainer"]
            if trainer.poll() == 0:
                break
            if fault_at is None and count_records(bootstrap, topics.groups_accepted) >= 1:
                fault_at = time.monotonic() - started
                inject(fault, stages, broker, cluster)
            time.sleep(0.5)
        else:
            detail = f"no end within {timeout_s:.0f} s"
        log = (workdir / "logs" / "trainer.log").read_text(errors="replace")
        finished = [line for line in log.splitlines() if "trainer finished:" in line]
        if finished:
            outcome = finished[-1].split("trainer finished:")[1].split()[0]
            detail = detail or finished[-1].split("trainer finished:")[1].strip()
    except Exception as exc:  # the experiment reports, it does not raise
        detail = f"{type(exc).__name__}: {exc}"
    finally:
        rollout.stop()
        stages.close()
    try:
        report = run_audit(bootstrap, topics, False, workdir / "runs" / name / "batches.jsonl")
        audit = (report.ok, [c.name for c in report.failed], report.counts, report.dead_letters)
    except Exception as exc:
        audit = (False, [f"audit raised {type(exc).__name__}: {exc}"], {}, {})
    finally:
        if broker is not None:
            broker.stop()
        if cluster is not None:
            cluster.stop()
    return FaultResult(fault, outcome, *audit, dict(stages.restarts), fault_at, round(time.monotonic() - started, 1),
                       detail)


def inject(fault: str, stages: StageProcesses, broker: EmbeddedBroker | None, cluster: EmbeddedCluster | None) -> None:
    """SIGKILL a stage (``kill:<stage>``: the supervisor restarts it), stop the broker for 5 s
    (``broker``), or SIGKILL node 2 of the cluster and start it 10 s later (``cluster-node``);
    the broker restarts run on a thread so the supervisor keeps checking meanwhile."""
    if fault.startswith("kill:"):
        os.kill(stages.procs[fault.split(":", 1)[1]].pid, signal.SIGKILL)
    elif fault == "broker":
        def bounce() -> None:
            broker.stop()
            time.sleep(5)
            broker.start(timeout=120)
        threading.Thread(target=bounce, daemon=True).start()
    elif fault == "cluster-node":
        node = cluster.nodes[1]

        def bounce() -> None:
            node.kill()
            time.sleep(10)
            node.start(timeout=120)
        threading.Thread(target=bounce, daemon=True).start()
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")


PIPELINE_CONFIGS = {"rlvr": REPO / "tests" / "chaos" / "rlvr_small.yaml",
                    "agentic": REPO / "tests" / "chaos" / "agentic_small.yaml"}


def pipeline_run(workdir: Path, fault: str, bootstrap, timeout_s: float = 900.0) -> FaultResult:
    """``rollstream run`` of a small real config on ``bootstrap`` with the stage of
    ``pipeline:<stage>`` SIGKILLed once the first payloads are written (two responses or
    trajectories: the run is under way); rollstream run's supervisor restarts it."""
    stage = fault.split(":", 1)[1]
    kind = "agentic" if stage in ("group-queue", "env") else "rlvr"
    workdir.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load(PIPELINE_CONFIGS[kind].read_text())
    raw["name"] = f"chaos-{stage}-{uuid.uuid4().hex[:6]}"
    raw["kafka"] = {**raw["kafka"], "bootstrap_servers": str(bootstrap), "topic_prefix": f"{raw['name']}."}
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_dir = workdir / "runs" / raw["name"]
    topics = Topics(raw["kafka"]["topic_prefix"])
    payloads = topics.trajectories if kind == "agentic" else topics.responses
    started = time.monotonic()
    fault_at, detail = None, ""
    with open(workdir / "run.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollstream", "run", str(config_path)], cwd=workdir,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if fault_at is None and count_records(bootstrap, payloads) >= 2:
                pids = json.loads((run_dir / "stages.json").read_text())
                os.kill(pids[stage], signal.SIGKILL)
                fault_at = time.monotonic() - started
            time.sleep(1.0)
        if proc.poll() is None:
            proc.kill()
            detail = f"no end within {timeout_s:.0f} s"
    finally:
        proc.wait(30)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    try:
        report = run_audit(bootstrap, topics, kind == "agentic", run_dir / "batches.jsonl")
        audit = (report.ok, [c.name for c in report.failed], report.counts, report.dead_letters)
    except Exception as exc:
        audit = (False, [f"audit raised {type(exc).__name__}: {exc}"], {}, {})
    return FaultResult(fault, summary.get("outcome", "error"), *audit, summary.get("stage_restarts", {}), fault_at,
                       round(time.monotonic() - started, 1), detail or summary.get("detail") or "")
