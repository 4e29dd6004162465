"""The agentic group queue on the real broker: a faust worker subprocess, with synthetic
trajectories (no model) or real env workers (the model on CPU, real environments)."""

from __future__ import annotations

import pytest

from rollstream.app.producer import start_env_groups
from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.tools.readback import read_values

from .harness import SyntheticEnvs, start_stages, wait_for, write_agentic_config

pytestmark = pytest.mark.integration


def keys(bootstrap: str, topic: str) -> list[str]:
    return [g["group_key"] for g in read_values(bootstrap, topic)]


def metric(bootstrap: str, topics, name: str) -> list[dict]:
    return [m for m in read_values(bootstrap, topics.metrics) if m["name"] == name]


def test_stuck_group_never_delays_another(kafka_broker, topic_factory, tmp_path):
    """Group 0's runs never come back; group 1 is still emitted, and group 0's episode is later
    dropped at its deadline (after one reissue) and replaced, never hanging."""
    topics = topic_factory(partitions=1)
    path = write_agentic_config(tmp_path, topics, 1, manager={
        "num_env_groups": 2, "episode_timeout_s": 4.0, "max_reissues_per_episode": 1, "max_replaced_episodes": 1})
    stages = start_stages(path, kafka_broker, tmp_path / "logs", Stage.group_queue)
    envs = SyntheticEnvs(kafka_broker, topics, lambda req: None if req["group_id"] == 0 else
                         {"response_level_rewards": float(req["traj_index"])})
    envs.start()
    try:
        start_env_groups(load_config(path), kafka_broker)
        wait_for(lambda: keys(kafka_broker, topics.groups_accepted) == ["train/1/0"], timeout=120,
                 what="group 1 accepted", stages=stages)
        assert not [r for r in envs.requests if r["cause"] == "reissue"]  # group 1 did not wait for 0's deadline
        wait_for(lambda: "train/0/0" in keys(kafka_broker, topics.groups_rejected), timeout=120,
                 what="group 0 dropped at its deadline", stages=stages)
        (stuck,) = [g for g in read_values(kafka_broker, topics.groups_rejected) if g["group_key"] == "train/0/0"]
        assert (stuck["reason"], stuck["reissues"], stuck["trajectories"]) == ("episode_timeout", 1, [])
        requests0 = [(r["episode_id"], r["traj_index"], r["cause"]) for r in envs.requests if r["group_id"] == 0]
        assert requests0[:4] == [(0, 0, "start"), (0, 1, "start"), (0, 2, "reissue"), (0, 3, "reissue")]
        assert (1, 0, "start") in requests0  # the replacement episode
        wait_for(lambda: len(metric(kafka_broker, topics, "group_queue/done")) == 2, timeout=60,
                 what="group 0 exhausted")
    finally:
        envs.stop()
        stages.close()
    done = {m["labels"]["group_id"]: m["labels"]["status"] for m in metric(kafka_broker, topics, "group_queue/done")}
    assert done == {"0": "exhausted", "1": "complete"}  # bounded: 1 replacement, then group 0 stops


FAULT_ENVS = "tests.workers.fault_envs"


def trajectories(bootstrap: str, topics) -> list[dict]:
    return read_values(bootstrap, topics.trajectories)


def test_failing_environment_gives_env_failed_runs_and_a_replacement_episode(kafka_broker, topic_factory, tmp_path):
    """Every reset raises: the env worker emits env_failed trajectories (it does not die), the
    group queue sets each aside (infra_abort), refills once, then drops the episode as
    refill_exhausted and starts episode 1 with the next seed; bounded by max_replaced_episodes."""
    topics = topic_factory(partitions=1)
    path = write_agentic_config(
        tmp_path, topics, 1,
        manager={"refill": {"max_refills_per_group": 1}, "max_replaced_episodes": 1},
        env={"env_type": f"{FAULT_ENVS}:FailingEnv", "env_config": {"fail_on": "reset"}})
    stages = start_stages(path, kafka_broker, tmp_path / "logs", Stage.group_queue, Stage.env)
    try:
        start_env_groups(load_config(path), kafka_broker)
        wait_for(lambda: len(metric(kafka_broker, topics, "group_queue/done")) == 1, timeout=180,
                 what="group 0 exhausted", stages=stages)
        played = trajectories(kafka_broker, topics)
    finally:
        stages.close()
    seed = load_config(path).group_seed("train", 0)
    assert played and all(t["env_failed"] and t["drop_flag"] and t["stop_reason"] == "env_failed" for t in played)
    assert all("reset exploded on purpose" in t["error"] for t in played)
    rejected = read_values(kafka_broker, topics.groups_rejected)
    decided = [(g["group_key"], g["reason"], g["seed"]) for g in rejected if g["reason"] != "infra_abort"]
    assert decided == [("train/0/0", "refill_exhausted", seed), ("train/0/1", "refill_exhausted", seed + 1)]
    assert sum(g["reason"] == "infra_abort" for g in rejected) >= 4  # 2 runs + 1 refill of ep 0, 2+ of ep 1
    assert read_values(kafka_broker, topics.groups_accepted) == []
    (done,) = metric(kafka_broker, topics, "group_queue/done")
    assert done["labels"]["status"] == "exhausted"
    assert sum(m["value"] for m in metric(kafka_broker, topics, "group_queue/episodes_replaced")) == 1


def test_redundancy_closes_the_group_while_its_slowest_run_still_plays(kafka_broker, topic_factory, tmp_path):
    """group_size 2 + 1 redundant run; the first environment built sleeps 12 s in its step. The
    group closes with the two fast runs; the slow one arrives later, is counted as late, and the
    time redundancy saved is reported."""
    topics = topic_factory(partitions=1)
    path = write_agentic_config(
        tmp_path, topics, 1, manager={"group_size_redundancy": 1},
        env={"env_type": f"{FAULT_ENVS}:SlowEnv", "env_config": {"delay_s": 12.0, "episode_len": 1},
             "env_step_timeout_s": 60.0})
    stages = start_stages(path, kafka_broker, tmp_path / "logs", Stage.group_queue, Stage.env)
    try:
        start_env_groups(load_config(path), kafka_broker)
        wait_for(lambda: metric(kafka_broker, topics, "group_queue/redundancy_saved_ms"), timeout=240,
                 what="the slow run to arrive late", stages=stages)
    finally:
        stages.close()
    (group,) = read_values(kafka_broker, topics.groups_accepted)
    played = trajectories(kafka_broker, topics)
    assert len(played) == 3
    slow = max(played, key=lambda t: t["finished_ms"])
    members = sorted(t["traj_index"] for t in group["trajectories"])
    assert slow["traj_index"] not in members and len(members) == 2
    assert group["created_ms"] < slow["finished_ms"]  # emitted before the slowest run finished
    (late,) = metric(kafka_broker, topics, "group_queue/late_trajectories")
    (saved,) = metric(kafka_broker, topics, "group_queue/redundancy_saved_ms")
    assert late["value"] == 1 and saved["value"] >= 8_000


def test_a_killed_env_workers_runs_are_reissued_after_the_deadline(kafka_broker, topic_factory, tmp_path):
    """Two env worker instances own one partition each; the one owning the group's partition is
    killed (SIGKILL) before it plays anything. At the episode deadline the missing runs are
    reissued one partition away, the live worker plays them, and the group is emitted."""
    from kafka.partitioner.default import murmur2

    topics = topic_factory(partitions=2)
    path = write_agentic_config(tmp_path, topics, 2, manager={"episode_timeout_s": 20.0, "max_reissues_per_episode": 1})
    home = (murmur2(b"0") & 0x7FFFFFFF) % 2
    stages = start_stages(path, kafka_broker, tmp_path / "logs", Stage.group_queue)
    try:
        dead = stages.start(Stage.env, "--instance", str(home), "--instances", "2")
        stages.start(Stage.env, "--instance", str(1 - home), "--instances", "2")
        stages.procs[dead].kill()
        stages.procs[dead].wait()
        del stages.procs[dead]  # its death is the test, not a failure of the run
        start_env_groups(load_config(path), kafka_broker)
        wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), timeout=240,
                 what="the group completed by reissued runs", stages=stages)
    finally:
        stages.close()
    (group,) = read_values(kafka_broker, topics.groups_accepted)
    assert (group["group_key"], group["reissues"]) == ("train/0/0", 1)
    assert sorted(t["traj_index"] for t in group["trajectories"]) == [2, 3]  # the reissues, runs 0-1 never ran
    from rollstream.tools.readback import read_topic
    placed = {(r.value["traj_index"], r.value["cause"], r.partition)
              for r in read_topic(kafka_broker, topics.episodes_requests)}
    assert placed == {(0, "start", home), (1, "start", home), (2, "reissue", 1 - home), (3, "reissue", 1 - home)}


def test_hopeless_environment_ends_the_run_with_batch_underfilled(kafka_broker, topic_factory, tmp_path):
    """Every run fails and every group id spends its replacement budget: once all have stopped,
    the trainer gets the underfilled verdict and the run ends with outcome batch_underfilled
    (no hang, no crash), with the rejections counted by reason."""
    from rollstream.app.run import run_pipeline

    topics = topic_factory(partitions=1)
    path = write_agentic_config(
        tmp_path, topics, 1,
        manager={"num_env_groups": 2, "refill": {"max_refills_per_group": 0}, "max_replaced_episodes": 1},
        env={"env_type": f"{FAULT_ENVS}:FailingEnv", "env_config": {"fail_on": "reset"}},
        kafka={"bootstrap_servers": kafka_broker, "topic_prefix": topics.prefix, "partitions": 1},
        rollout_batch_size=4, min_fill_ratio=0.5, time_limit_s=240)
    summary = run_pipeline(load_config(path), run_dir=tmp_path / "run")
    assert summary["outcome"] == "batch_underfilled", summary
    assert "0/2 groups" in summary["detail"] and "refill_exhausted" in summary["detail"]
    assert summary["groups_rejected"] == {"refill_exhausted": 4}  # 2 group ids x (episode + 1 replacement)
    assert summary["episodes_replaced"] == 2 and summary["groups_accepted"] == 0
    assert summary["batches"] == []


def test_group_queue_state_survives_a_killed_worker(kafka_broker, topic_factory, tmp_path):
    """Run 0 of the episode arrives and is stored; the group-queue worker is SIGKILLed; a new one
    restores the table from its changelog, and when run 1 arrives the group is emitted exactly
    once with both runs (run 0 never re-played)."""
    from rollstream.kafka import names
    from rollstream.kafka.clients import make_producer
    from rollstream.schemas import encode
    from rollstream.tools.readback import read_topic

    from .harness import synthetic_trajectory

    topics = topic_factory(partitions=1)
    path = write_agentic_config(tmp_path, topics, 1)
    changelog = f"{names.app_id(topics, names.GROUP_QUEUE_APP)}-{names.GROUP_QUEUE_TABLE}-changelog"
    stages = start_stages(path, kafka_broker, tmp_path / "logs", Stage.group_queue)
    envs = SyntheticEnvs(kafka_broker, topics, lambda req: {"response_level_rewards": 1.0} if req["traj_index"] == 0 else None)
    envs.start()
    try:
        start_env_groups(load_config(path), kafka_broker)
        wait_for(lambda: any(r.key == b"t:train/0/0/0" for r in read_topic(kafka_broker, changelog)), timeout=120,
                 what="run 0 stored in the changelog", stages=stages)
        stages.procs["group-queue"].kill()
        stages.procs["group-queue"].wait()
        del stages.procs["group-queue"]
        (tmp_path / "logs" / "group-queue.log").rename(tmp_path / "logs" / "group-queue-killed.log")  # kept for a failure
        stages.start(Stage.group_queue)
        (run1,) = [r for r in envs.requests if r["traj_index"] == 1]
        producer = make_producer(kafka_broker)
        producer.send(topics.trajectories, key=b"0", value=encode(synthetic_trajectory(run1, 0.0), "Trajectory")).get(60)
        producer.close()
        wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), timeout=120,
                 what="the group after the restart", stages=stages)
    finally:
        envs.stop()
        stages.close()
    (group,) = read_values(kafka_broker, topics.groups_accepted)
    assert group["group_key"] == "train/0/0"
    assert [(t["traj_index"], t["response_level_rewards"]) for t in group["trajectories"]] == [(0, 1.0), (1, 0.0)]
    assert sorted((r["episode_id"], r["traj_index"]) for r in envs.requests) == [(0, 0), (0, 1)]  # no second start
    # decision plane: the changelog kept run 0's summary, and the group names each payload by the
    # exact record of `trajectories` it was read at
    (stored,) = [r for r in read_topic(kafka_broker, changelog) if r.key == b"t:train/0/0/0" and r.value]
    assert stored.schema == "TrajectorySummary" and "turns" not in stored.value
    payloads = {(r.topic, r.partition, r.offset): r for r in read_topic(kafka_broker, topics.trajectories)}
    for member in group["trajectories"]:
        ref = member["payload"]
        record = payloads[(ref["topic"], ref["partition"], ref["offset"])]
        assert ref["size_bytes"] == len(record.raw)
        assert (record.value["traj_index"], record.value["response_level_rewards"]) == (
            member["traj_index"], member["response_level_rewards"])
        assert (member["num_turns"], member["response_length"]) == (1, len(record.value["response_mask"])) == (1, 2)
    assert stored.value["payload"] == group["trajectories"][0]["payload"]
