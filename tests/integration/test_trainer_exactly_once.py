"""Exactly one training per group: the trainer commits its input offsets only after the step and
its checkpoint (written while the next step trains) are durable; a trainer killed anywhere and restarted neither trains a group twice
nor skips one. Real broker, real `rollstream worker trainer` processes (SmolLM2), SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.tools.readback import read_values
from rollstream.trainer.checkpoint import CheckpointStore
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings

from tests.tiny_models import tiny_model
from .harness import wait_for, write_config
from .test_trainer_consumer import RESPONSES, produce

pytestmark = pytest.mark.integration


def manifest(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def test_a_crash_between_checkpoint_and_commit_neither_retrains_nor_skips(kafka_broker, topic_factory, tmp_path):
    """The step of batch 0 and its checkpoint are durable, then the trainer dies before the
    manifest line and the offset commit. The restarted trainer resumes from the checkpoint,
    records batch 0 as ``recovered``, skips its redelivered group and trains the next one."""
    topics = topic_factory(["groups.accepted", "batches", "dead-letter", "responses"])
    produce(kafka_broker, topics, ["a", "b"])
    store, manifest_path = CheckpointStore(tmp_path / "ckpt"), tmp_path / "batches.jsonl"

    def start():
        trainer = PolicyTrainer(TrainSettings(lr=1e-2), TrainInferCorrectionConfig(), model=tiny_model(vocab=256),
                                checkpoints=store)
        builder = BatchBuilder(kafka_broker, topics, 1, group_id=f"{topics.prefix}trainer", manifest_path=manifest_path)
        if trainer.resumed is not None:
            builder.recover(trainer.resumed)
        return trainer, builder

    trainer, builder = start()
    batch = builder.next_batch(timeout_s=30)
    assert batch.group_keys == ["a"]
    trainer.train(batch)  # checkpoint v1 durable ...
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    builder.close()  # ... and the crash: no manifest line, no commit

    trainer, builder = start()
    try:
        assert trainer.policy_version == 1
        assert all(torch.equal(trained[k], v) for k, v in trainer.model.state_dict().items())
        batch = builder.next_batch(timeout_s=30)
        assert (batch.step, batch.group_keys) == (1, ["b"])  # "a" redelivered and skipped
        assert builder.duplicates == 1
        # the duplicate's payloads are never read: only b's responses were fetched
        assert builder.metrics()["trainer/batch/payload_records_fetched"] == RESPONSES
        builder.commit(batch, trainer.train(batch))
    finally:
        builder.close()
    lines = manifest(manifest_path)
    assert [(e["step"], e["status"], e["group_keys"], e["policy_version"]) for e in lines] == [
        (0, "recovered", ["a"], 1), (1, "complete", ["b"], 2)]


def test_sigkilled_trainer_processes_train_every_group_exactly_once(kafka_broker, topic_factory, tmp_path):
    """Three steps of one group each with the real model; the trainer is SIGKILLed while writing
    the checkpoint of step 1 (on its writer thread), and again as soon as that checkpoint is
    durable (before its commit, as a rule: the batch is committed after the write). Each restart
    resumes; in the end every group is in exactly one step and one checkpoint."""
    topics = topic_factory()
    config = write_config(tmp_path, topics, 1, rollout_batch_size=1, max_steps=3,
                          actor_train={"lr": 1e-5, "micro_batch_size": 4, "keep_checkpoints": 2})
    run_dir = tmp_path / "runs" / "it"
    ckpt, manifest_path = run_dir / "checkpoints", run_dir / "batches.jsonl"
    logs: list[Path] = []

    def start() -> subprocess.Popen:
        log = tmp_path / f"trainer-{len(logs)}.log"
        logs.append(log)
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "rollstream", "worker", "trainer", "--config", str(config),
                                     "--bootstrap", kafka_broker], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)

    def alive(proc: subprocess.Popen) -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode}:\n{logs[-1].read_text()[-3000:]}")
        return True

    def kill(proc: subprocess.Popen) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    proc = start()
    try:
        produce(kafka_broker, topics, ["k0"])
        wait_for(lambda: alive(proc) and len(manifest(manifest_path)) == 1, timeout=240, what="step 0")
        produce(kafka_broker, topics, ["k1"])
        wait_for(lambda: alive(proc) and any(ckpt.glob(".v000002.tmp-*")), timeout=240, interval=0.005,
                 what="the checkpoint of step 1 being written")
        kill(proc)  # torn checkpoint v2, step 1 neither recorded nor committed

        proc = start()
        wait_for(lambda: alive(proc) and (ckpt / "v000002" / "trainer_state.json").is_file(), timeout=240,
                 interval=0.005, what="the checkpoint of step 1 after the first restart")
        kill(proc)  # v2 durable; the manifest line and the offset commit may or may not have followed

        proc = start()
        produce(kafka_broker, topics, ["k2"])
        proc.wait(240)
        assert proc.returncode == 0, logs[-1].read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    lines = manifest(manifest_path)
    assert [(e["step"], e["group_keys"], e["policy_version"]) for e in lines] == [
        (0, ["k0"], 1), (1, ["k1"], 2), (2, ["k2"], 3)]
    store = CheckpointStore(ckpt)
    assert store.versions() == [2, 3] and not list(ckpt.glob(".v*"))  # the two newest kept
    for version, key in ((2, "k1"), (3, "k2")):
        state = json.loads((store.path_of(version) / "trainer_state.json").read_text())
        assert (state["step"], state["group_keys"]) == (version - 1, [key])
    published = [p["version"] for p in read_values(kafka_broker, topics.policy_versions)]
    assert max(published) == 3 and published == sorted(published)
    batches = {b["step"]: b for b in read_values(kafka_broker, topics.batches)}  # at least once per step
    assert sorted(batches) == [0, 1, 2] and [batches[s]["group_keys"] for s in range(3)] == [["k0"], ["k1"], ["k2"]]
    assert "resumed from" in logs[1].read_text() and "resumed from" in logs[2].read_text()
