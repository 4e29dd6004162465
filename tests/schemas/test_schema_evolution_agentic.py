"""TrajectoryGroup's ``unit`` field (schema history v2) and the GroupQueueOutcome event."""

from __future__ import annotations

import json

from rollstream.schemas import REGISTRY, SchemaRegistry, decode, encode
from rollstream.schemas.codec import SCHEMA_DIR

HISTORY_V2 = SCHEMA_DIR / "history" / "trajectory_group.v2.avsc"


def _writer(schema_file) -> SchemaRegistry:
    writer = SchemaRegistry()
    writer.add(json.loads((SCHEMA_DIR / "trajectory.avsc").read_text()))
    writer.add(json.loads(schema_file.read_text()))
    return writer


def test_history_v2_is_the_current_schema_without_unit():
    old = json.loads(HISTORY_V2.read_text())
    current = json.loads((SCHEMA_DIR / "trajectory_group.avsc").read_text())
    assert [f["name"] for f in old["fields"]] == [f["name"] for f in current["fields"] if f["name"] != "unit"]
    assert current["fields"][-1]["name"] == "trajectories"  # still last: stored bytes are spliced in


def test_a_trajectory_group_written_before_unit_existed_still_decodes_as_an_episode():
    data = _writer(HISTORY_V2).encode({"group_key": "train/0/0/1", "group_id": 0, "episode_id": 0,
                                       "accepted": False, "reason": "infra_abort", "filter_config": "{}",
                                       "trajectories": []}, "TrajectoryGroup")
    assert data[2:10] != REGISTRY.fingerprint("TrajectoryGroup")
    name, record = REGISTRY.decode(data)
    assert (name, record["reason"], record["filter_config"], record["unit"]) == (
        "TrajectoryGroup", "infra_abort", "{}", "episode")


def test_unit_round_trips():
    record = {"group_key": "train/0/0/1", "unit": "trajectory", "group_id": 0, "episode_id": 0,
              "accepted": False, "reason": "invalid_reward", "trajectories": []}
    assert decode(encode(record, "TrajectoryGroup"))[1]["unit"] == "trajectory"


def test_group_queue_outcome_round_trips():
    outcome = {"mode": "train", "group_id": 3, "status": "exhausted", "accepted": 1, "rejected": 2,
               "rejected_by_reason": {"zero_std": 1, "stale": 1}, "episodes_decided": 3, "replaced": 2,
               "created_ms": 1_700_000_000_000}
    assert decode(encode(outcome, "GroupQueueOutcome")) == ("GroupQueueOutcome", outcome)
