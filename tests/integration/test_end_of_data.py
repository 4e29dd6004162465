"""Epochs and end of data on the real broker: the admission re-reads the prompts for a second
epoch; its end-of-data verdict ends the trainer loop and `rollstream worker trainer` at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from rollstream.app.stages import Stage
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.schemas import encode
from rollstream.schemas.records import PROMPTS_END_KEY, batch_event, prompts_end
from rollstream.tools.readback import read_values
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.loop import LoopControl
from rollstream.trainer.manifest import Manifest
from rollstream.trainer.verdicts import verdict_action

from .harness import SyntheticRollout, commit_every_batch, produce, prompt, start_stages, wait_for, write_config
from .test_trainer_consumer import produce as produce_groups
from .test_trainer_loop import accepted_group

pytestmark = pytest.mark.integration


def first_sample_passes(prompt_id: str, index: int, round_: int) -> tuple[float, str]:
    return float(index == 0), "stop"  # rewards [1, 0, 0, 0]: std > 0, every group accepted


def end_data(bootstrap: str, topics: Topics, prompts: int) -> None:
    producer = make_producer(bootstrap)
    try:
        producer.send(topics.prompts, key=PROMPTS_END_KEY, value=encode(prompts_end(prompts, "test"), "PromptsEnd"))
        producer.flush()
    finally:
        producer.close()


def verdicts(bootstrap: str, topics: Topics) -> list[dict]:
    return [b for b in read_values(bootstrap, topics.batches) if b["status"] in ("underfilled", "end_of_data")]


def test_verdict_action():
    verdict = {"status": "end_of_data", "accepted_groups": 2, "target_groups": 4}
    assert verdict_action(verdict, 0.5) == "ship_partial"
    assert verdict_action(verdict, 1.0) == "end"
    assert verdict_action({**verdict, "accepted_groups": 0}, 0.0) == "end"
    assert verdict_action({**verdict, "status": "underfilled"}, 1.0) == "fail"
    with pytest.raises(ValueError, match="complete"):
        verdict_action({**verdict, "status": "complete"}, 0.5)


def test_two_epochs_read_every_train_prompt_twice_then_one_end_of_data_verdict(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=4, max_steps=5, num_epochs=2)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(kafka_broker, topics, first_sample_passes)
    rollout.start()
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt("p0"), prompt("p1"), prompt("v0", mode="val"),
                                                         prompt("p2")])
        end_data(kafka_broker, topics, 4)
        wait_for(lambda: verdicts(kafka_broker, topics), timeout=180, what="the end-of-data verdict", stages=stages)
        admitted = sorted(r["prompt_id"] for r in rollout.requests if r["round"] == 0)
        assert admitted == ["p0", "p0#e1", "p1", "p1#e1", "p2", "p2#e1", "v0"]  # v0 is not repeated
        accepted = sorted(g["prompt_id"] for g in read_values(kafka_broker, topics.groups_accepted))
        assert accepted == ["p0", "p0#e1", "p1", "p1#e1", "p2", "p2#e1"]
        [verdict] = verdicts(kafka_broker, topics)
        # step 0 filled with 4 groups; step 1 got the other 2 when the data ran out
        assert {k: verdict[k] for k in ("status", "step", "target_groups", "accepted_groups", "prompts_consumed",
                                        "rejected_by_reason")} == {
            "status": "end_of_data", "step": 1, "target_groups": 4, "accepted_groups": 2, "prompts_consumed": 2,
            "rejected_by_reason": {}}
        # a prompt after the end is a clear dead letter; a second marker changes nothing
        produce(kafka_broker, topics.prompts, "Prompt", [prompt("late")])
        end_data(kafka_broker, topics, 1)
        wait_for(lambda: read_values(kafka_broker, topics.dead_letter), timeout=60, what="a dead letter", stages=stages)
        [dead] = read_values(kafka_broker, topics.dead_letter)
        assert (dead["reason"], dead["error"]) == ("invalid_event", "prompt after the end of data (PromptsEnd at offset 4)")
        assert len(verdicts(kafka_broker, topics)) == 1 and "late" not in {r["prompt_id"] for r in rollout.requests}
    finally:
        rollout.stop()
        stages.close()


def setup_verdict(kafka_broker, topics: Topics, groups: list[str], step: int, accepted: int) -> None:
    produce_groups(kafka_broker, topics, [accepted_group(pid) for pid in groups])
    producer = make_producer(kafka_broker)
    try:
        producer.send(topics.batches, key=str(step).encode(), value=encode(batch_event(
            step=step, status="end_of_data", target=4, accepted=accepted, prompts_consumed=accepted), "Batch"))
        producer.flush()
    finally:
        producer.close()


def manifest(run_dir: Path) -> list[dict]:
    return Manifest(run_dir / "batches.jsonl").entries()


def loop(kafka_broker, topics: Topics, tmp_path: Path, min_fill_ratio: float, **control):
    return commit_every_batch(kafka_broker, topics, tmp_path, 4, 10, min_fill_ratio=min_fill_ratio,
                              control=LoopControl(**control))


def test_end_of_data_ships_the_full_batches_then_the_rest_as_a_final_partial_batch(kafka_broker, topic_factory,
                                                                                     tmp_path):
    topics = topic_factory()
    setup_verdict(kafka_broker, topics, ["a", "b", "c", "d", "e", "f"], step=1, accepted=2)
    shown = []  # (batches committed, groups in) at each progress report
    result = loop(kafka_broker, topics, tmp_path, 0.5,
                  on_progress=lambda result, buffered: shown.append((result.steps, buffered)))
    assert (result.outcome, result.detail) == (
        "end_of_data", "step 1: 2/4 groups after 2 prompts (min_fill_ratio 0.5); rejected: {}")
    # a batch's groups are shown while it trains, before its commit (once the bar stayed short)
    assert any(committed == 0 and groups >= 4 for committed, groups in shown), shown
    assert (result.steps, result.groups, result.last["step"]) == (2, 6, 1)
    assert [(b["step"], b["status"], b["group_keys"], b.get("end_of_data")) for b in manifest(tmp_path)] == [
        (0, "complete", ["a", "b", "c", "d"], None), (1, "partial", ["e", "f"], True)]


def test_a_restarted_trainer_ends_at_once_on_the_verdict_it_already_answered(kafka_broker, topic_factory, tmp_path):
    # the run ended end_of_data after its final partial batch (step 1); a trainer restarted with
    # the same manifest re-reads that verdict and an older underfilled one: it ships nothing more
    topics = topic_factory()
    producer = make_producer(kafka_broker)
    try:
        producer.send(topics.batches, key=b"0", value=encode(batch_event(
            step=0, status="underfilled", target=4, accepted=1, prompts_consumed=9), "Batch"))
        producer.flush()
    finally:
        producer.close()
    setup_verdict(kafka_broker, topics, ["a", "b", "c", "d", "e", "f"], step=1, accepted=2)
    first = loop(kafka_broker, topics, tmp_path, 0.5)
    assert (first.steps, [b["status"] for b in manifest(tmp_path)]) == (2, ["complete", "partial"])
    again = loop(kafka_broker, topics, tmp_path, 0.5)  # before: batch_underfilled, on the step-0 verdict
    assert (again.outcome, again.steps, again.last) == ("end_of_data", 0, None)


def test_end_of_data_below_min_fill_ratio_ends_and_keeps_the_groups(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    setup_verdict(kafka_broker, topics, ["a", "b"], step=0, accepted=2)
    result = loop(kafka_broker, topics, tmp_path, 1.0)
    assert (result.outcome, result.steps) == ("end_of_data", 0)
    # nothing was committed: a later trainer with the same group id still gets both groups
    again = BatchBuilder(kafka_broker, topics, 2, group_id=f"{topics.prefix}trainer", manifest_path=tmp_path / "m2.jsonl")
    try:
        assert sorted(again.next_batch(timeout_s=30).group_keys) == ["a", "b"]
    finally:
        again.close()


def test_worker_trainer_ends_on_end_of_data(kafka_broker, topic_factory, tmp_path):
    """More resampling budget than prompts: admission decides the 3 prompts and gives the
    verdict. `rollstream worker trainer` under ``min_fill_ratio: 1.0`` ships nothing and exits
    on its own; the next one, under 0.5, ships the same 3 groups as a final partial batch."""
    topics = topic_factory(partitions=2)
    settings = dict(rollout_batch_size=4, max_prompts_per_batch=64, max_steps=3, actor_train={"enabled": False})
    (tmp_path / "strict").mkdir()
    (tmp_path / "lenient").mkdir()
    strict = write_config(tmp_path / "strict", topics, 2, min_fill_ratio=1.0, **settings)
    lenient = write_config(tmp_path / "lenient", topics, 2, min_fill_ratio=0.5, **settings)
    stages = start_stages(strict, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(kafka_broker, topics, first_sample_passes)
    rollout.start()
    manifest_path = tmp_path / "runs" / "it" / "batches.jsonl"

    def trainer(config: Path, log: Path) -> str:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "rollstream", "worker", "trainer", "--config", str(config),
                                     "--bootstrap", kafka_broker], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: proc.poll() is not None, timeout=240, what="the trainer to exit", stages=stages)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, log.read_text()[-3000:]
        return log.read_text()

    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}") for i in range(3)])
        end_data(kafka_broker, topics, 3)
        text = trainer(strict, tmp_path / "trainer-strict.log")
        assert "trainer finished: end_of_data step 0: 3/4 groups after 3 prompts (min_fill_ratio 1.0)" in text
        assert not manifest_path.exists() or manifest_path.read_text() == ""
        text = trainer(lenient, tmp_path / "trainer-lenient.log")
        assert "trainer finished: end_of_data step 0: 3/4 groups after 3 prompts (min_fill_ratio 0.5)" in text
    finally:
        rollout.stop()
        stages.close()
    [entry] = [json.loads(line) for line in manifest_path.read_text().splitlines()]
    assert (entry["step"], entry["status"], sorted(entry["group_keys"]), entry["end_of_data"]) == (
        0, "partial", ["p0", "p1", "p2"], True)
    [verdict] = verdicts(kafka_broker, topics)  # exactly one, read by both trainers
    assert (verdict["status"], verdict["accepted_groups"]) == ("end_of_data", 3)


def test_an_admission_stopped_mid_epoch_resumes_without_duplicates_or_gaps(kafka_broker, topic_factory, tmp_path):
    """Three epochs, one prompt in flight at a time. The admission is stopped while the first
    prompt of epoch 1 is generating, and a new one started: it gets the end marker again and
    resumes at the saved position; every prompt of every epoch is admitted exactly once."""
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=4, max_running_prompts=1, max_steps=5,
                          num_epochs=3)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    held, release = [], threading.Event()

    def script(prompt_id: str, index: int, round_: int) -> tuple[float, str]:
        if "#e1" in prompt_id and not held:  # hold the first epoch-1 prompt until the restart
            held.append(prompt_id)
            release.wait(120)
        return first_sample_passes(prompt_id, index, round_)

    rollout = SyntheticRollout(kafka_broker, topics, script)
    rollout.start()
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}") for i in range(4)])
        end_data(kafka_broker, topics, 4)
        wait_for(lambda: held, timeout=180, what="the first prompt of epoch 1", stages=stages)
        admission = stages.procs.pop("admission")
        admission.send_signal(signal.SIGTERM)
        admission.wait(60)
        (tmp_path / "logs" / "admission.log").rename(tmp_path / "logs" / "admission-stopped.log")
        stages.start(Stage.admission)
        release.set()
        wait_for(lambda: verdicts(kafka_broker, topics), timeout=180, what="the end-of-data verdict", stages=stages)
    finally:
        release.set()
        rollout.stop()
        stages.close()
    admitted = Counter(r["prompt_id"] for r in rollout.requests if r["round"] == 0)
    assert admitted == Counter([f"p{i}{suffix}" for i in range(4) for suffix in ("", "#e1", "#e2")])
    [verdict] = verdicts(kafka_broker, topics)
    assert (verdict["status"], verdict["step"], verdict["accepted_groups"], verdict["prompts_consumed"]) == (
        "end_of_data", 3, 0, 0)
