"""End to end, agentic: the bundled FrozenLake example, shrunk for CI, through `run_pipeline` on
the real broker with the real model (SmolLM2-135M on CPU) playing real text games (textarena
FrozenLake-v0 and gymnasium FrozenLake-v1)."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from rollstream.app.run import run_pipeline
from rollstream.config import AgenticConfig, parse_config
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import read_topic, read_values
from tests.tools.test_export import check_export

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
GROUP_SIZE = 2
MAX_TOKENS_PER_STEP = 8
MAX_REPLACED = 6
FORMAT_PENALTY = -0.1

# every key of the RLVR summary (rollstream.tools.summary.summarize_rlvr) ...
RLVR_KEYS = {
    "outcome", "detail", "elapsed_seconds", "prompts_admitted", "responses_generated", "replacement_requests",
    "replacement_responses_requested", "groups_accepted", "groups_rejected", "domains", "batches",
    "retention_rate", "responses_per_accepted_response", "validation", "reward", "dead_letters",
    "finish_reasons", "response_tokens_mean",
}
# ... plus the group queue's own figures
AGENTIC_KEYS = {"episodes_replaced", "late_trajectories", "group_filter_count"}


def small_config(bootstrap: str, prefix: str) -> AgenticConfig:
    data = yaml.safe_load((ROOT / "examples" / "agentic_frozenlake.yaml").read_text())
    data["name"] = "e2e-agentic"
    data["kafka"] = {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "partitions": 2}
    data.update(rollout_batch_size=2 * GROUP_SIZE, max_steps=1, min_fill_ratio=1.0, time_limit_s=400)
    # Train plays gymnasium's lake, validation textarena's (as in the example), so both env kinds
    # run. Why not textarena in train: SmolLM2-135M never writes a move textarena accepts (two
    # refusals in a row end its game), so every textarena run of 2 actions returns exactly
    # 2 x format_penalty, every group has std 0 and that group id would spend its replacement
    # budget for nothing. On the gym lake a parseable move is occasional: rewards vary.
    train = data["train_env_manager"]
    train.update(tags=["GymFrozenLake"], num_env_groups=2, num_groups_partition=[2], group_size=GROUP_SIZE,
                 group_size_redundancy=1, max_replaced_episodes=MAX_REPLACED,
                 group_filter_config={"std_threshold": 0.0})
    data["val_env_manager"].update(num_env_groups=1, group_size=2, tags=["FrozenLake"])
    for env in data["custom_envs"].values():
        env.update(max_actions_per_traj=2, max_tokens_per_step=MAX_TOKENS_PER_STEP, format_penalty=FORMAT_PENALTY)
    config = parse_config(data)
    assert isinstance(config, AgenticConfig) and config.groups_per_batch == 2
    return config


def check_trajectory(t: dict, mode: str) -> None:
    """``t``: a Trajectory as read back from ``trajectories`` (packed arrays: numpy)."""
    assert t["mode"] == mode
    assert t["turns"], "a played trajectory has at least one model turn"
    assert 1 <= len(t["turns"]) <= 2  # max_actions_per_traj
    flat_mask: list[int] = []
    for k, turn in enumerate(t["turns"]):
        prompt, response = turn["prompt_token_ids"].tolist(), turn["response_token_ids"].tolist()
        logprobs = turn["infer_logprobs"].tolist()
        assert prompt, "every turn starts with the environment's (chat-templated) text"
        assert 1 <= len(response) <= MAX_TOKENS_PER_STEP
        assert all(isinstance(tok, int) and 0 <= tok < 49152 for tok in prompt + response)  # SmolLM2 vocabulary
        assert len(logprobs) == len(response)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
        assert turn["finish_reason"] in ("stop", "length")
        if k:
            flat_mask += [0] * len(prompt)  # the environment's answer: not trained
        flat_mask += [1] * len(response)
    # the flattened response: turns[0].response, turns[1].prompt, turns[1].response, ...
    assert t["response_mask"].tolist() == flat_mask
    model_logprobs = [lp for turn in t["turns"] for lp in turn["infer_logprobs"].tolist()]
    assert int(t["response_mask"].sum()) == len(model_logprobs)
    invalid = sum(turn["invalid_move"] for turn in t["turns"])
    assert t["step_rewards"] == [turn["step_reward"] for turn in t["turns"]]
    assert t["response_level_rewards"] == pytest.approx(sum(t["step_rewards"]) + FORMAT_PENALTY * invalid)
    assert t["stop_reason"] in ("done", "max_actions")
    assert not (t["env_timeout"] or t["env_failed"] or t["drop_flag"]) and t["error"] is None
    assert t["extras"] == {}


def check_member(summary: dict, payloads: dict, mode: str) -> None:
    """A group member: a TrajectorySummary whose PayloadRef names the Trajectory it summarises
    on ``trajectories`` (``payloads``: (topic, partition, offset) -> record read back)."""
    ref = summary["payload"]
    assert set(ref) == {"topic", "partition", "offset", "size_bytes"}, "members name their payload by reference"
    record = payloads[(ref["topic"], ref["partition"], ref["offset"])]
    assert ref["size_bytes"] == len(record.raw)
    t = record.value
    check_trajectory(t, mode)
    for field in ("mode", "group_id", "episode_id", "traj_index", "seed", "tag", "response_level_rewards",
                  "step_rewards", "stop_reason", "policy_version"):
        assert summary[field] == t[field], field
    assert (summary["num_turns"], summary["prompt_length"], summary["response_length"], summary["model_tokens"]) == (
        len(t["turns"]), len(t["turns"][0]["prompt_token_ids"]), len(t["response_mask"]), int(t["response_mask"].sum()))


def test_agentic_example_through_every_stage(kafka_broker, tmp_path):
    prefix = f"e2e-ag-{uuid.uuid4().hex[:8]}."
    config = small_config(kafka_broker, prefix)
    summary_path = tmp_path / "summary.json"
    run_dir = tmp_path / "run"
    summary = run_pipeline(config, summary_json=summary_path, run_dir=run_dir)

    assert json.loads(summary_path.read_text()) == summary
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["outcome"] == "complete", summary
    assert summary["detail"] == ""
    assert set(summary) >= RLVR_KEYS | AGENTIC_KEYS
    (batch,) = summary["batches"]
    assert (batch["step"], batch["status"], batch["groups"]) == (0, "complete", 2)
    assert batch["trajectories_per_group"] == [GROUP_SIZE, GROUP_SIZE]
    assert batch["responses_per_group"] == batch["trajectories_per_group"]

    topics = Topics(prefix)
    accepted_records = list(read_topic(kafka_broker, topics.groups_accepted))
    assert {r.schema for r in accepted_records} == {"TrajectoryGroup"}
    accepted = [r.value for r in accepted_records]
    rejected_all = read_values(kafka_broker, topics.groups_rejected)
    validation = read_values(kafka_broker, topics.groups_validation)
    requests = read_values(kafka_broker, topics.episodes_requests)
    trajectory_records = list(read_topic(kafka_broker, topics.trajectories))
    trajectories = [r.value for r in trajectory_records]
    payloads = {(r.topic, r.partition, r.offset): r for r in trajectory_records}
    metrics = read_values(kafka_broker, topics.metrics)

    # -- the accepted groups: one per train group id (each delivers one episode)
    assert summary["groups_accepted"] == len(accepted) == 2
    assert sorted((g["group_id"], g["tag"], g["env_type"]) for g in accepted) == [
        (0, "GymFrozenLake", "frozen_lake"), (1, "GymFrozenLake", "frozen_lake")]
    assert summary["domains"]["FrozenLake"] == {"accepted": 0, "rejected": 0}  # val only
    assert summary["domains"]["GymFrozenLake"]["accepted"] == 2
    for g in accepted:
        assert (g["kind"], g["mode"], g["accepted"], g["reason"]) == ("agentic", "train", True, "accepted")
        assert g["group_key"] == f"train/{g['group_id']}/{g['episode_id']}"
        assert g["seed"] == config.group_seed("train", g["group_id"]) + g["episode_id"]
        assert g["group_filter_cls"] == "env_failure_std"  # the example names the built-in
        assert len(g["trajectories"]) == GROUP_SIZE
        assert g["trajectories_started"] == GROUP_SIZE + 1  # group_size + redundancy
        assert len({t["traj_index"] for t in g["trajectories"]}) == GROUP_SIZE
        for t in g["trajectories"]:
            assert (t["group_id"], t["episode_id"], t["seed"], t["tag"]) == (
                g["group_id"], g["episode_id"], g["seed"], g["tag"])
            check_member(t, payloads, "train")
        # kept by the std filter: the rewards vary, and the recorded std is theirs (float32, n-1)
        rewards = torch.tensor([t["response_level_rewards"] for t in g["trajectories"]], dtype=torch.float32)
        assert g["decision_values"]["std"] == pytest.approx(rewards.std().item(), abs=1e-6)
        assert g["decision_values"]["std"] > 0.0
    manifest = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [m["step"] for m in manifest] == [0]
    assert sorted(manifest[0]["group_keys"]) == sorted(g["group_key"] for g in accepted)

    # -- rejected groups and their replacements
    aborted = [g for g in rejected_all if g["reason"] == "infra_abort"]
    rejected = [g for g in rejected_all if g["reason"] != "infra_abort"]
    assert summary["infra_aborts"] == len(aborted)
    by_reason: dict[str, int] = {}
    for g in rejected:
        assert (g["mode"], g["accepted"]) == ("train", False)
        by_reason[g["reason"]] = by_reason.get(g["reason"], 0) + 1
    assert summary["groups_rejected"] == by_reason
    requested = {(r["mode"], r["group_id"], r["episode_id"]) for r in requests}
    decided_no = rejected + [g for g in validation if not g["accepted"]]
    # max_traj_per_env 1: episode e of a group id is replaced by episode e + 1
    replaced = [g for g in decided_no if (g["mode"], g["group_id"], g["episode_id"] + 1) in requested]
    assert summary["episodes_replaced"] == len(replaced)
    per_group = {gid: sum(1 for g in rejected if g["group_id"] == gid) for gid in (0, 1)}
    assert summary["episodes_replaced"] == sum(min(n, MAX_REPLACED) for n in per_group.values())
    replaced_metrics = [m for m in metrics if m["name"] == "group_queue/episodes_replaced"]
    assert sum(m["value"] for m in replaced_metrics) == summary["episodes_replaced"]
    assert summary["group_filter_count"] == sum(
        1 for g in rejected if g["reason"] not in ("refill_exhausted", "episode_timeout"))
    for gid, n in per_group.items():  # the accepted episode came after the rejected ones
        (acc,) = [g for g in accepted if g["group_id"] == gid]
        assert acc["episode_id"] == n
    assert summary["retention_rate"] == round(2 / (2 + len(rejected)), 4)
    # redundancy 1: at most one run per decided train episode can arrive after its decision
    assert 0 <= summary["late_trajectories"] <= len(accepted) + len(rejected)

    # -- what was played
    assert summary["episodes_started"] == summary["prompts_admitted"] == len(requested)
    assert summary["trajectories_played"] == summary["responses_generated"] == len(trajectories)
    assert summary["requests_by_cause"].get("start", 0) == sum(1 for r in requests if r["cause"] == "start")
    train_episodes = {(gid, e) for mode, gid, e in requested if mode == "train"}
    assert sum(1 for r in requests if r["mode"] == "train" and r["cause"] == "start") == 3 * len(train_episodes)
    assert set(summary["finish_reasons"]) <= {"done", "max_actions"}
    assert 1.0 <= summary["turns_mean"] <= 2.0

    # -- validation bypasses the filter
    val = summary["validation"]
    assert val["groups"] == val["original"] == len(validation) == val["accepted"] + val["rejected"]
    assert val["groups"] <= 1
    for g in validation:
        assert (g["mode"], g["group_id"], g["tag"], g["env_type"], g["accepted"]) == (
            "val", 0, "FrozenLake", "frozen_lake_textarena", True)
        assert len(g["trajectories"]) == 2
        for t in g["trajectories"]:
            check_member(t, payloads, "val")

    assert summary["dead_letters"] == 0
    assert read_values(kafka_broker, topics.dead_letter) == []
    # the recorded run exported: a row per trajectory of every decided group, tokens as fetched
    check_export(kafka_broker, prefix, True, run_dir / "config.yaml", tmp_path)
