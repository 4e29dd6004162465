"""TrajectoryGroup across its schema history and the GroupQueueOutcome event.

History (``rollstream/schemas/history``, each file self-contained): v1 (no filter_config), v2
(+ filter_config, filter_config_hash), v3 (+ unit), all with the whole Trajectory inline as
``array<int>`` / ``array<float>`` token arrays. The current TrajectoryGroup lists
TrajectorySummaries whose ``payload`` is a PayloadRef; an old event decodes into that shape with
the (upgraded, packed) Trajectory inline as the payload: nothing to fetch, nothing lost.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollstream.schemas import REGISTRY, SchemaRegistry, decode, encode
from rollstream.schemas.codec import SCHEMA_DIR
from rollstream.schemas.records import is_payload_ref, payload_ref, trajectory_summary

HISTORY = {v: SCHEMA_DIR / "history" / f"trajectory_group.v{v}.avsc" for v in (1, 2, 3)}


def _fields(path) -> list[str]:
    return [f["name"] for f in json.loads(path.read_text())["fields"]]


def _writer(version: int) -> SchemaRegistry:
    """A registry that writes TrajectoryGroup as the history file says (self-contained)."""
    writer = SchemaRegistry()
    writer.add(json.loads(HISTORY[version].read_text()))
    return writer


def _old_trajectory(traj_index: int, reward: float) -> dict:
    """A Trajectory as the old schemas held it: plain int/float arrays, two turns."""
    return {
        "mode": "train", "group_id": 3, "episode_id": 1, "traj_index": traj_index, "tag": "lake",
        "env_type": "frozen_lake", "seed": 41,
        "turns": [
            {"prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8], "infer_logprobs": [-0.5, -0.25],
             "response_text": "[down]", "action": "down", "invalid_move": False, "step_reward": 0.0,
             "finish_reason": "stop", "env_ms": 1.5},
            {"prompt_token_ids": [9, 10], "response_token_ids": [11], "infer_logprobs": [-1.0],
             "response_text": "[right]", "action": "right", "invalid_move": False, "step_reward": reward,
             "finish_reason": "length", "env_ms": 2.0},
        ],
        "response_mask": [1, 1, 0, 0, 1], "step_rewards": [0.0, reward], "response_level_rewards": reward,
        "success": reward > 0, "stop_reason": "done", "env_timeout": False, "env_failed": False,
        "drop_flag": False, "error": None, "policy_version": 2, "started_ms": 10, "finished_ms": 20,
        "worker": "env-0",
    }


def _old_group(version: int) -> dict:
    group = {"group_key": "train/3/1", "kind": "agentic", "mode": "train", "group_id": 3, "episode_id": 1,
             "tag": "lake", "env_type": "frozen_lake", "seed": 41, "accepted": True, "reason": "accepted",
             "decision_values": {"std": 0.7071}, "group_filter_cls": "pkg:Filter", "policy_version": 2,
             "trajectories_started": 3, "trajectories_arrived": 2, "refills": 0, "reissues": 0, "created_ms": 99,
             "trajectories": [_old_trajectory(0, 1.0), _old_trajectory(2, 0.0)]}
    if version >= 2:
        group.update(filter_config='{"group_filter_cls": "pkg:Filter"}', filter_config_hash="abc")
    if version >= 3:
        group["unit"] = "episode"
    return group


def test_each_history_version_adds_only_its_fields_and_trajectories_stays_last():
    current = _fields(SCHEMA_DIR / "trajectory_group.avsc")
    assert _fields(HISTORY[3]) == current  # v3 -> current changed the members' type, not the fields
    assert _fields(HISTORY[2]) == [f for f in current if f != "unit"]
    assert _fields(HISTORY[1]) == [f for f in current if f not in ("unit", "filter_config", "filter_config_hash")]
    for path in (*HISTORY.values(), SCHEMA_DIR / "trajectory_group.avsc"):
        assert _fields(path)[-1] == "trajectories"  # last: stored member bytes are spliced in
    items = json.loads((SCHEMA_DIR / "trajectory_group.avsc").read_text())["fields"][-1]["type"]["items"]
    assert items == "rollstream.events.TrajectorySummary"


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_old_trajectory_group_decodes_into_summaries_with_the_trajectory_inline(version):
    old = _old_group(version)
    data = _writer(version).encode(old, "TrajectoryGroup")
    assert data[2:10] != REGISTRY.fingerprint("TrajectoryGroup")
    name, group = REGISTRY.decode(data)
    assert name == "TrajectoryGroup"
    # the group's own fields, defaults for those its version lacked
    assert (group["group_key"], group["accepted"], group["reason"], group["decision_values"]) == (
        "train/3/1", True, "accepted", {"std": 0.7071})
    assert group["unit"] == "episode"
    assert group["filter_config"] == ("" if version == 1 else '{"group_filter_cls": "pkg:Filter"}')
    # members: summaries computed from the old trajectory, which rides along as the payload
    assert [t["traj_index"] for t in group["trajectories"]] == [0, 2]
    for member, before in zip(group["trajectories"], old["trajectories"]):
        assert "turns" not in member and "response_mask" not in member
        assert (member["num_turns"], member["prompt_length"], member["response_length"], member["model_tokens"]) == (
            2, 3, 5, 3)
        assert (member["response_level_rewards"], member["step_rewards"], member["stop_reason"]) == (
            before["response_level_rewards"], before["step_rewards"], "done")
        assert (member["policy_version"], member["worker"], member["seed"]) == (2, "env-0", 41)
        payload = member["payload"]
        assert not is_payload_ref(payload)
        assert payload["extras"] == {}
        assert payload["response_mask"].dtype == np.uint8
        assert payload["response_mask"].tolist() == before["response_mask"]
        for got, want in zip(payload["turns"], before["turns"]):
            assert got["prompt_token_ids"].dtype == np.int32 and got["infer_logprobs"].dtype == np.float32
            assert got["prompt_token_ids"].tolist() == want["prompt_token_ids"]
            assert got["response_token_ids"].tolist() == want["response_token_ids"]
            assert got["infer_logprobs"].tolist() == want["infer_logprobs"]
            assert (got["response_text"], got["action"], got["finish_reason"]) == (
                want["response_text"], want["action"], want["finish_reason"])
    # and the upgraded group re-encodes in the current schema without loss
    assert decode(encode(group, "TrajectoryGroup"))[1]["trajectories"][1]["payload"]["turns"][1][
        "response_token_ids"].tolist() == [11]


def test_a_set_aside_written_before_unit_existed_still_decodes_as_an_episode():
    old = {"group_key": "train/0/0/1", "group_id": 0, "episode_id": 0, "accepted": False, "reason": "infra_abort",
           "filter_config": "{}", "trajectories": []}
    name, record = REGISTRY.decode(_writer(2).encode(old, "TrajectoryGroup"))
    assert (name, record["reason"], record["filter_config"], record["unit"], record["trajectories"]) == (
        "TrajectoryGroup", "infra_abort", "{}", "episode", [])


def test_a_current_trajectory_group_carries_summaries_and_references():
    trajectory = {**_old_trajectory(0, 1.0), "extras": {}}
    ref = payload_ref("lake.trajectories", 1, 12345, 321)
    record = {"group_key": "train/0/0/1", "unit": "trajectory", "group_id": 0, "episode_id": 0,
              "accepted": False, "reason": "invalid_reward", "trajectories": [trajectory_summary(trajectory, ref)]}
    decoded = decode(encode(record, "TrajectoryGroup"))[1]
    assert decoded["unit"] == "trajectory"
    (member,) = decoded["trajectories"]
    assert member["payload"] == ref and is_payload_ref(member["payload"])
    assert (member["num_turns"], member["response_length"], member["model_tokens"]) == (2, 5, 3)


def test_group_queue_outcome_round_trips():
    outcome = {"mode": "train", "group_id": 3, "status": "exhausted", "accepted": 1, "rejected": 2,
               "rejected_by_reason": {"zero_std": 1, "stale": 1}, "episodes_decided": 3, "replaced": 2,
               "created_ms": 1_700_000_000_000}
    assert decode(encode(outcome, "GroupQueueOutcome")) == ("GroupQueueOutcome", outcome)
