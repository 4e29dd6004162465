"""Events written in an older format, brought to the current one after decoding.

Schema evolution by Avro resolution covers added fields with defaults; the change to packed
arrays and payload references is not such a change (an ``array<int>`` does not
resolve to ``bytes``). So an event of an older writer schema is decoded with the newest history
version the upgrade covers (Avro resolution from older versions to that one), then converted here;
later history versions (e.g. before ``messages`` existed) resolve to the current schema. An
upgraded payload-carrying decision event keeps its payload inline (``payload`` is the Response or
Trajectory itself, not a PayloadRef): nothing to fetch, nothing lost.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rollstream.schemas.records import response_summary, trajectory_summary


def _arrays(record: dict, fields: dict[str, type]) -> dict:
    return {**record, **{f: np.asarray(record[f], dtype=dt) for f, dt in fields.items()}}


def upgrade_response(old: dict) -> dict:
    """Response v1 (int/float arrays) -> Response (packed arrays, extras, no chat messages, no
    list of versions: policy_version alone)."""
    return {**_arrays(old, {"prompt_token_ids": np.int32, "response_token_ids": np.int32,
                            "infer_logprobs": np.float32}), "extras": {}, "messages": [], "policy_versions": []}


def upgrade_rewarded_response(old: dict, prompt_token_ids: list[int] | None = None) -> dict:
    """RewardedResponse v1 (the whole Response nested) -> RewardedResponse (summary + inline
    payload). ``prompt_token_ids``: the group's, for responses stored without their own."""
    response = dict(old["response"])
    if not response["prompt_token_ids"] and prompt_token_ids:
        response["prompt_token_ids"] = prompt_token_ids
    payload = upgrade_response(response)
    rest = {k: v for k, v in old.items() if k != "response"}
    return {"response": response_summary(payload), **rest, "payload": payload}


def upgrade_group(old: dict) -> dict:
    """Group v1 (responses inline, group prompt_token_ids) -> Group (small members)."""
    prompt_ids = old.get("prompt_token_ids") or []
    group = {k: v for k, v in old.items() if k != "prompt_token_ids"}
    group["messages"] = []
    group["responses"] = [upgrade_rewarded_response(rr, prompt_ids) for rr in old["responses"]]
    return group


def upgrade_trajectory(old: dict) -> dict:
    """Trajectory v1 (int/float arrays) -> Trajectory (packed arrays, extras)."""
    turns = [_arrays(turn, {"prompt_token_ids": np.int32, "response_token_ids": np.int32,
                            "infer_logprobs": np.float32}) for turn in old["turns"]]
    return {**old, "turns": turns, "response_mask": np.asarray(old["response_mask"], dtype=np.uint8),
            "extras": {}}


def upgrade_trajectory_group(old: dict) -> dict:
    """TrajectoryGroup v3 (trajectories inline) -> TrajectoryGroup (summaries, inline payload)."""
    members = []
    for traj in old["trajectories"]:
        payload = upgrade_trajectory(traj)
        members.append(trajectory_summary(payload, payload))
    return {**old, "trajectories": members}


UPGRADES: dict[str, tuple[int, Callable[[dict], dict]]] = {
    "Response": (1, upgrade_response),
    "RewardedResponse": (1, upgrade_rewarded_response),
    "Group": (1, upgrade_group),
    "Trajectory": (1, upgrade_trajectory),
    "TrajectoryGroup": (3, upgrade_trajectory_group),
}
"""Schema name -> (last history version covered, conversion of a record decoded with that version)."""
