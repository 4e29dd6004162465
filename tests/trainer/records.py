"""Builders of the records the trainer reads, in the payload/decision format: payloads
(``Response``, ``Trajectory``) and the small decision events that name them (``RewardedResponse``,
``TrajectorySummary``, ``Group``, ``TrajectoryGroup``). A member's ``payload`` is the payload itself
(inline, as ``build_batch`` wants it after the fetch) unless a ``PayloadRef`` is given; on Kafka,
``write_payloads`` writes the payloads the real way and returns the group naming them by reference.
"""

from __future__ import annotations

import io

import fastavro
from fastavro.schema import parse_schema

from rollstream.kafka.payloads import PayloadWriter
from rollstream.schemas import encode
from rollstream.schemas.codec import MAGIC, REGISTRY, fingerprint_of
from rollstream.schemas.records import (
    group_rows,
    is_payload_ref,
    is_trajectory_group,
    response_summary,
    trajectory_summary,
)


def response_payload(prompt_id: str, sample_index: int, prompt, tokens, logprobs, *, version: int = 0,
                     extras: dict | None = None, domain: str = "math") -> dict:
    """A ``Response`` record (the payload on ``responses``)."""
    return {
        "prompt_id": prompt_id, "domain": domain, "mode": "train", "prompt": "q", "ground_truth": "",
        "round": 0, "sample_index": sample_index, "prompt_token_ids": prompt, "response_token_ids": tokens,
        "infer_logprobs": logprobs, "response_text": "", "finish_reason": "stop", "error": None,
        "policy_version": version, "generation_ms": 0.0, "created_ms": 0, "extras": dict(extras or {}),
    }


def rewarded(response: dict, reward: float, payload: dict | None = None) -> dict:
    """The ``RewardedResponse`` of ``response``: its summary, ``reward``, and ``payload`` (a
    ``PayloadRef``; default: the Response inline)."""
    return {"response": response_summary(response), "response_level_reward": reward, "scores": {}, "meta": {},
            "reward_error": None, "reward_ms": 0.0, "payload": response if payload is None else payload}


def rlvr_group(key: str, responses: list[dict], *, accepted: bool = True, version: int = 0,
               reason: str | None = None) -> dict:
    """A ``Group`` record of ``responses`` (RewardedResponse records)."""
    return {
        "group_key": key, "kind": "rlvr", "prompt_id": key, "domain": "math", "mode": "train",
        "accepted": accepted, "reason": reason or ("accepted" if accepted else "all_equal"),
        "decision_values": {}, "filter_config": "{}", "filter_config_hash": "", "policy_version": version,
        "rounds": 1, "responses_generated": len(responses), "prompt": "q", "ground_truth": "",
        "created_ms": 0, "responses": responses,
    }


def turn(prompt, tokens, logprobs) -> dict:
    """A ``Turn`` record with only the fields the batch reads filled in."""
    return {"prompt_token_ids": prompt, "response_token_ids": tokens, "infer_logprobs": logprobs,
            "response_text": "", "action": "", "invalid_move": False, "step_reward": 0.0, "finish_reason": "stop",
            "env_ms": 0.0}


def trajectory_payload(traj_index: int, turns: list[dict], mask, reward: float, *, version: int = 0,
                       group_id: int = 0, episode_id: int = 0, extras: dict | None = None) -> dict:
    """A ``Trajectory`` record (the payload on ``trajectories``); ``mask`` its flattened
    response_mask."""
    return {"mode": "train", "group_id": group_id, "episode_id": episode_id, "traj_index": traj_index, "tag": "",
            "env_type": "sokoban", "seed": 0, "turns": turns, "response_mask": mask, "step_rewards": [],
            "response_level_rewards": reward, "success": False, "stop_reason": "done", "env_timeout": False,
            "env_failed": False, "drop_flag": False, "error": None, "policy_version": version, "started_ms": 0,
            "finished_ms": 0, "worker": "", "extras": dict(extras or {})}


def member(trajectory: dict, payload: dict | None = None) -> dict:
    """The ``TrajectorySummary`` of ``trajectory`` naming ``payload`` (default: inline)."""
    return trajectory_summary(trajectory, trajectory if payload is None else payload)


def traj_group(key: str, members: list[dict], *, accepted: bool = True, version: int = 0,
               group_id: int = 0, episode_id: int = 0) -> dict:
    """A ``TrajectoryGroup`` record of ``members`` (TrajectorySummary records)."""
    return {"group_key": key, "kind": "agentic", "group_id": group_id, "episode_id": episode_id,
            "accepted": accepted, "reason": "accepted" if accepted else "all_equal", "policy_version": version,
            "trajectories_started": len(members), "trajectories_arrived": len(members), "trajectories": members}


def group_schema_of(group: dict) -> str:
    return "TrajectoryGroup" if is_trajectory_group(group) else "Group"


def write_payloads(producer, responses_topic: str, trajectories_topic: str, group: dict) -> dict:
    """Write every inline payload of ``group`` to its payload topic (``PayloadWriter``, keyed
    like the workers: prompt_id / group_id) and return a copy naming them by ``PayloadRef``."""
    trajectory = is_trajectory_group(group)
    inline = [m for m in group_rows(group) if not is_payload_ref(m["payload"])]
    items = [(trajectories_topic, str(m["payload"]["group_id"]), encode(m["payload"], "Trajectory")) if trajectory
             else (responses_topic, m["payload"]["prompt_id"], encode(m["payload"], "Response")) for m in inline]
    refs = iter(PayloadWriter(producer).write(items))
    members = [{**m, "payload": m["payload"] if is_payload_ref(m["payload"]) else next(refs)}
               for m in group_rows(group)]
    return {**group, ("trajectories" if trajectory else "responses"): members}


def encode_history(record: dict, file: str) -> bytes:
    """``record`` encoded with an older writer schema (``history/<file>``), as a producer of that
    format wrote it."""
    contained = REGISTRY.self_contained_file(file)
    buf = io.BytesIO()
    buf.write(MAGIC + fingerprint_of(contained))
    fastavro.schemaless_writer(buf, parse_schema(contained), record)
    return buf.getvalue()
