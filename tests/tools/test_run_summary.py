"""The run summary: the split of the trainer's stale rejections from the filters' decisions, and
(on the real broker) figures read from the decision plane only: the payload topics are never
fetched, so a run whose payload topics hold nothing readable still has its response and
trajectory figures."""

from __future__ import annotations

import pytest

from rollstream.config import parse_config
from rollstream.kafka.clients import make_producer
from rollstream.observability.metrics import metric_record
from rollstream.schemas import encode
from rollstream.schemas.records import payload_ref, response_summary, trajectory_summary
from rollstream.kafka.readback import count_records, first_record_ms
from rollstream.tools.readback import filter_decisions
from rollstream.tools.summary import LiveSummary, startup_seconds, summarize_agentic, summarize_rlvr, trained_groups
from tests.trainer import records


def test_groups_accepted_by_the_filters_then_stale_at_the_trainer_are_not_filter_rejections():
    accepted = [{"group_key": "p0"}, {"group_key": "p1"}]
    rejected = [{"group_key": "p2", "reason": "zero_std"}, {"group_key": "p1", "reason": "stale"}]
    filters, stale = filter_decisions(accepted, rejected)
    assert (filters, stale) == ([{"group_key": "p2", "reason": "zero_std"}], 1)


def test_accepted_groups_split_into_trained_stale_dead_lettered_and_left_untrained():
    batches = [{"accepted_groups": 4}, {"accepted_groups": 2}]  # a full batch, then a partial one
    accepted = [{"group_key": f"g{i}"} for i in range(9)] + [{"group_key": "g0"}]  # g0 redelivered
    assert trained_groups(accepted, 1, batches, [], "x.groups.accepted") == {"groups_trained": 6, "groups_untrained": 2}
    # the trainer dead-lettered g8 (a payload it could not train); a malformed event and another
    # topic's dead letter name no accepted group
    member = records.rewarded(records.response_payload("g8", 0, [1], [2], [-0.5]), 1.0)
    dead = [{"source_topic": "x.groups.accepted", "payload": encode(records.rlvr_group("g8", [member]), "Group")},
            {"source_topic": "x.groups.accepted", "payload": b"\x00garbage"},
            {"source_topic": "x.responses.rewarded", "payload": encode(records.rlvr_group("g7", [member]), "Group")}]
    assert trained_groups(accepted, 1, batches, dead, "x.groups.accepted") == {"groups_trained": 6, "groups_untrained": 1}
    assert trained_groups([], 0, [], [], "x.groups.accepted") == {"groups_trained": 0, "groups_untrained": 0}


def send(bootstrap: str, topic: str, schema: str | None, records: list, key: str = "k") -> None:
    producer = make_producer(bootstrap)
    for record in records:
        producer.send(topic, key=key.encode(), value=record if schema is None else encode(record, schema))
    producer.flush()
    producer.close()


# -- RLVR ---------------------------------------------------------------------------------------

def rewarded(topics, pid: str, index: int, tokens: int, finish: str, version: int, reward: float,
             mode: str = "train") -> dict:
    body = {"prompt_id": pid, "domain": "synth", "mode": mode, "prompt": "q", "round": 0, "sample_index": index,
            "prompt_token_ids": [1, 2, 3], "response_token_ids": list(range(tokens)), "response_text": "x",
            "finish_reason": finish, "policy_version": version}
    # the reference names a Response that was never written: the summary must not need it
    return {"response": response_summary(body), "response_level_reward": reward, "scores": {"acc": reward},
            "meta": {}, "payload": payload_ref(topics.responses, 0, 1000 + index, 4096)}


def rlvr_group(pid: str, members: list[dict], accepted: bool, reason: str, mode: str = "train") -> dict:
    return {"group_key": pid, "prompt_id": pid, "domain": "synth", "mode": mode, "accepted": accepted,
            "reason": reason, "responses": members}


@pytest.mark.integration
def test_rlvr_response_figures_come_from_responses_rewarded(kafka_broker, topic_factory):
    topics = topic_factory()
    config = parse_config({"name": "s", "rollout_batch_size": 1, "num_return_sequences_in_group": 2,
                           "max_prompts_per_batch": 8, "datasets": [],
                           "rewards": {"synth": {"reward_type": "gsm8k"}}})
    p0 = [rewarded(topics, "p0", 0, 4, "stop", 0, 1.0), rewarded(topics, "p0", 1, 2, "length", 0, 0.0)]
    p1 = [rewarded(topics, "p1", 0, 6, "stop", 1, 0.0), rewarded(topics, "p1", 1, 8, "stop", 1, 0.0)]
    val = [rewarded(topics, "v0", 0, 10, "stop", 1, 1.0, mode="val")]
    send(kafka_broker, topics.responses_rewarded, "RewardedResponse", p0 + p1 + val)
    send(kafka_broker, topics.groups_accepted, "Group", [rlvr_group("p0", p0, True, "accepted")])
    send(kafka_broker, topics.groups_rejected, "Group", [rlvr_group("p1", p1, False, "zero_std")])
    send(kafka_broker, topics.groups_validation, "Group", [rlvr_group("v0", val, True, "accepted", "val")])
    send(kafka_broker, topics.generation_requests, "GenerationRequest", [
        {"prompt_id": p, "domain": "synth", "mode": m, "prompt": "q", "round": 0, "num_return_sequences": n}
        for p, m, n in (("p0", "train", 2), ("p1", "train", 2), ("v0", "val", 1))])
    assert count_records(kafka_broker, topics.responses) == 0  # no payload at all

    summary = summarize_rlvr(config, kafka_broker, topics, [], "complete", "", 1.0)
    assert summary["responses_generated"] == 5 and summary["prompts_admitted"] == 3
    assert summary["finish_reasons"] == {"length": 1, "stop": 4}
    assert summary["response_tokens_mean"] == round((4 + 2 + 6 + 8 + 10) / 5, 1) == 6.0
    assert summary["generated_by_policy_version"] == {"0": 2, "1": 3}
    assert summary["responses_per_accepted_response"] == round(4 / 2, 3)  # train responses / accepted ones
    assert (summary["groups_accepted"], summary["groups_rejected"], summary["retention_rate"]) == (1, {"zero_std": 1}, 0.5)
    assert summary["reward"] == {"all": 0.25, "accepted": 0.5}
    assert summary["validation"]["groups"] == 1 and summary["validation"]["correct_mean"] == 1.0
    assert summary["group_arrival_lag_ms"] == {"groups": 0}  # no batch trained
    assert (summary["groups_trained"], summary["groups_untrained"]) == (0, 1)  # the run ended before a batch

    batch = {"step": 0, "status": "complete", "accepted_groups": 2, "responses_per_group": [2, 2],
             "fill_seconds": 1.0, "arrival_lag_ms": [12, 30]}
    # a group event without its decision time (created_ms 0) has no lag: None, left out
    trained = summarize_rlvr(config, kafka_broker, topics, [batch, {**batch, "step": 1, "arrival_lag_ms": [18, 20]},
                                                            {**batch, "step": 2, "arrival_lag_ms": [None, None]}],
                             "complete", "", 1.0)
    assert trained["group_arrival_lag_ms"] == {"groups": 4, "p50": 19.0, "p90": 27.0, "p99": 29.7, "max": 30,
                                               "mean": 20.0}


@pytest.mark.integration
def test_the_trackers_live_summary_is_the_summary_of_the_records_so_far_each_read_once(kafka_broker, topic_factory):
    """LiveSummary (what the experiment trackers read after each step) reads on from its last
    call and gives summarize_rlvr's figures of what the topics hold at that moment; the workers'
    metric snapshots are not kept (no tracker figure needs them)."""
    topics = topic_factory(partitions=2)
    config = parse_config({"name": "s", "rollout_batch_size": 1, "num_return_sequences_in_group": 2,
                           "max_prompts_per_batch": 8, "datasets": [], "rewards": {"synth": {"reward_type": "gsm8k"}}})
    live = LiveSummary(config, kafka_broker, topics)

    def check(expected_accepted: int) -> dict:
        summary, full = live(), summarize_rlvr(config, kafka_broker, topics, [], "running", "", 0.0)
        assert summary["groups_accepted"] == expected_accepted and summary["weight_updates"] == []
        drop = ("elapsed_seconds", "weight_updates")
        assert {k: v for k, v in summary.items() if k not in drop} == {k: v for k, v in full.items() if k not in drop}
        return full

    try:
        assert check(0)["validation"]["by_policy_version"] == {}  # nothing yet: no topic read fails
        p0 = [rewarded(topics, "p0", 0, 4, "stop", 0, 1.0), rewarded(topics, "p0", 1, 2, "length", 0, 0.0)]
        val = [rewarded(topics, "v0", i, 3, "stop", 0, float(i == 0), mode="val") for i in range(2)]
        send(kafka_broker, topics.responses_rewarded, "RewardedResponse", p0 + val)
        send(kafka_broker, topics.groups_accepted, "Group", [rlvr_group("p0", p0, True, "accepted")])
        send(kafka_broker, topics.groups_validation, "Group", [rlvr_group("v0", val, True, "accepted", "val")])
        check(1)
        p1 = [rewarded(topics, "p1", i, 6, "stop", 1, 0.0) for i in range(2)]
        val1 = [rewarded(topics, "v0#v1", i, 3, "stop", 1, 1.0, mode="val") for i in range(2)]
        send(kafka_broker, topics.responses_rewarded, "RewardedResponse", p1 + val1)
        send(kafka_broker, topics.groups_rejected, "Group", [rlvr_group("p1", p1, False, "zero_std")])
        send(kafka_broker, topics.groups_validation, "Group", [rlvr_group("v0#v1", val1, True, "accepted", "val")])
        send(kafka_broker, topics.metrics, "Metric", [metric_record("gen-0", "rollstream_weight_update_ms", 42.0, {
            "server": "s0", "version": "1", "mode": "keep"}, 1)])
        full = check(1)
        assert full["weight_updates"] != [] and full["retention_rate"] == 0.5
        assert {v: row["accuracy"] for v, row in full["validation"]["by_policy_version"].items()} == {"0": 0.5, "1": 1.0}
        assert live._tail.values(topics.metrics) == []  # the snapshot was read and not kept
    finally:
        live.close()


@pytest.mark.integration
def test_startup_seconds_come_from_the_first_record_timestamps(kafka_broker, topic_factory):
    """The earliest record over every partition, read from the time index (nothing fetched); an
    empty topic gives None. The first token: the earliest stamp a generation worker published
    (a worker whose engine never sampled reports 0, and is not counted)."""
    topics = topic_factory(["generation.requests", "responses", "metrics"], partitions=2)
    assert first_record_ms(kafka_broker, topics.generation_requests) is None
    producer = make_producer(kafka_broker)
    for partition, stamp in ((0, 1_007_500), (1, 1_003_250), (0, 1_009_000)):
        producer.send(topics.generation_requests, value=b"x", partition=partition, timestamp_ms=stamp)
    producer.flush()
    assert first_record_ms(kafka_broker, topics.generation_requests) == 1_003_250
    assert first_record_ms(kafka_broker, "t-no-such-topic") is None
    assert startup_seconds(kafka_broker, topics, False, started_ms=1_000_000) == {
        "first_request": 3.25, "first_response": None, "first_token": None}
    for worker, stamp in (("gen-a", 1_006_000), ("gen-b", 1_004_500), ("gen-c", 0)):
        record = metric_record(worker, "rollstream_first_token_ms", stamp, {}, 1_010_000)
        producer.send(topics.metrics, value=encode(record, "Metric"))
    producer.flush()
    producer.close()
    assert startup_seconds(kafka_broker, topics, False, started_ms=1_000_000)["first_token"] == 4.5


# -- agentic ------------------------------------------------------------------------------------

def traj_summary(topics, mode: str, episode: int, index: int, mask: list[int], turns: int, reward: float,
                 stop: str = "done", version: int = 0) -> dict:
    trajectory = {
        "mode": mode, "group_id": 0, "episode_id": episode, "traj_index": index, "tag": "lake", "env_type": "x",
        "seed": 1, "turns": [{"prompt_token_ids": [1, 2], "response_token_ids": [3], "infer_logprobs": [-0.1]}] * turns,
        "response_mask": mask, "step_rewards": [reward], "response_level_rewards": reward, "success": reward > 0,
        "stop_reason": stop, "policy_version": version,
    }
    return trajectory_summary(trajectory, payload_ref(topics.trajectories, 0, 500 + index, 2048))


def agentic_group(mode: str, episode: int, members: list[dict], accepted: bool, reason: str,
                  unit: str = "episode", suffix: str = "") -> dict:
    return {"group_key": f"{mode}/0/{episode}{suffix}", "mode": mode, "unit": unit, "group_id": 0,
            "episode_id": episode, "tag": "lake", "accepted": accepted, "reason": reason, "trajectories": members}


@pytest.mark.integration
def test_agentic_trajectory_figures_come_from_the_group_events(kafka_broker, topic_factory):
    topics = topic_factory()
    config = parse_config({
        "name": "a", "rollout_batch_size": 2,
        "train_env_manager": {"num_env_groups": 1, "group_size": 2, "tags": ["lake"]},
        "custom_envs": {"lake": {"env_type": "frozen_lake"}}})
    kept = [traj_summary(topics, "train", 1, 0, [1, 1, 0, 1], 2, 1.0, version=1),
            traj_summary(topics, "train", 1, 1, [1, 1, 1, 1, 1], 1, 0.0, stop="max_actions", version=1)]
    dropped = [traj_summary(topics, "train", 0, 0, [1], 1, 0.0), traj_summary(topics, "train", 0, 1, [1, 1], 1, 0.0)]
    aside = traj_summary(topics, "train", 0, 2, [0, 1], 1, 0.0, stop="env_failed")
    val = traj_summary(topics, "val", 0, 0, [1, 1, 1], 3, 1.0)
    accepted = agentic_group("train", 1, kept, True, "accepted")
    send(kafka_broker, topics.groups_accepted, "TrajectoryGroup", [accepted])
    send(kafka_broker, topics.groups_rejected, "TrajectoryGroup", [
        agentic_group("train", 0, dropped, False, "zero_std"),
        agentic_group("train", 0, [aside], False, "infra_abort", unit="trajectory", suffix="/2"),
        {**accepted, "accepted": False, "reason": "stale"}])  # stale at the trainer: its trajectories count once
    send(kafka_broker, topics.groups_validation, "TrajectoryGroup", [agentic_group("val", 0, [val], True, "accepted")])
    send(kafka_broker, topics.metrics, "Metric", [
        metric_record("gq", "group_queue/late_trajectories", 1.0, {"mode": "train", "group_id": "0"}, 1)])
    # the payload topic: 7 records (6 above + 1 late run) that no reader could decode
    send(kafka_broker, topics.trajectories, None, [b"not a trajectory"] * 7, key="0")

    summary = summarize_agentic(config, kafka_broker, topics, [], "complete", "", 1.0)
    assert summary["trajectories_played"] == summary["responses_generated"] == 7  # from the offsets
    assert summary["late_trajectories"] == 1
    assert summary["response_tokens_mean"] == round((3 + 5 + 1 + 2 + 1 + 3) / 6, 1)  # model tokens
    assert summary["turns_mean"] == round((2 + 1 + 1 + 1 + 1 + 3) / 6, 2)
    assert summary["finish_reasons"] == {"done": 4, "env_failed": 1, "max_actions": 1}
    assert summary["generated_by_policy_version"] == {"0": 4, "1": 2}
    assert summary["success_rate"] == round(1 / 5, 4)  # train trajectories only
    # train trajectories played (5 in group events + 1 late) per accepted trajectory (2)
    assert summary["responses_per_accepted_response"] == 3.0
    assert summary["groups_stale_at_trainer"] == 1 and summary["groups_rejected"] == {"zero_std": 1}
    assert summary["infra_aborts"] == 1 and summary["trajectories_set_aside"] == {"infra_abort": 1}
    assert summary["validation"]["responses"] == 1 and summary["validation"]["correct_mean"] == 1.0
