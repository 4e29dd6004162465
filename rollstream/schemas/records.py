"""Pure helpers over the records several layers build or read (dicts matching the .avsc files).

A decided group is either an RLVR ``Group`` (its rows are ``responses``) or an agentic
``TrajectoryGroup`` (its rows are ``trajectories``); the helpers below are the one place that
tells them apart. ``batch_event`` builds the ``Batch`` record that both admission (``underfilled``
verdicts) and the trainer (one per committed batch) publish.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from rollstream.runtime import now_ms

# Response.finish_reason: eos sampled, max_new_tokens hit, or the engine failed.
FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = "stop", "length", "error"

# Trajectory.stop_reason: the game ended, a bound was hit, or an infrastructure failure (the last
# three are never the policy's doing: set aside, never reward 0).
STOP_DONE, STOP_MAX_ACTIONS, STOP_MAX_LENGTH = "done", "max_actions", "max_length"
STOP_ENV_TIMEOUT, STOP_ENV_FAILED, STOP_ENGINE_ERROR = "env_timeout", "env_failed", "engine_error"


def is_trajectory_group(group: Mapping) -> bool:
    """True for an agentic ``TrajectoryGroup`` record, False for an RLVR ``Group``."""
    return "trajectories" in group


def is_set_aside(group: Mapping) -> bool:
    """True for a ``TrajectoryGroup`` that carries one set-aside trajectory (``unit``
    ``"trajectory"``: infra_abort, invalid_reward, invalid_trajectory), not a group decision."""
    return group.get("unit") == "trajectory"


def group_schema(group: Mapping) -> str:
    """The Avro schema name of a decided group: ``"TrajectoryGroup"`` or ``"Group"``."""
    return "TrajectoryGroup" if is_trajectory_group(group) else "Group"


def group_rows(group: Mapping) -> list:
    """The group's rows: its trajectories (agentic) or its responses (RLVR).

    Raises:
        KeyError: an RLVR group without ``responses``.
    """
    return group["trajectories"] if is_trajectory_group(group) else group["responses"]


def batch_event(*, step: int, status: str, target: int, accepted: int, prompts_consumed: int = 0,
                rejected_by_reason: Mapping[str, int] | None = None, group_keys: Sequence[str] = (),
                offsets: Mapping[str, int] | None = None, fill_seconds: float = 0.0,
                created_ms: int | None = None) -> dict:
    """A ``Batch`` record (topic ``batches``, keyed by ``step``).

    Args:
        step: the trainer step the batch is for.
        status: ``underfilled`` or ``end_of_data`` (admission's verdicts), ``complete``,
            ``partial`` or ``recovered`` (trainer).
        target: groups a full batch has; ``accepted``: groups it has (or admission accepted).
        prompts_consumed, rejected_by_reason: admission's counts for an underfilled batch.
        group_keys: the batch's groups; ``offsets``: partition (as str) -> next offset committed.
        fill_seconds: seconds from the step's first poll to the batch being built.
        created_ms: event time in ms since the epoch; None: now.
    """
    return {
        "step": step, "status": status, "target_groups": target, "accepted_groups": accepted,
        "prompts_consumed": prompts_consumed, "rejected_by_reason": dict(rejected_by_reason or {}),
        "group_keys": list(group_keys), "offsets": dict(offsets or {}), "fill_seconds": fill_seconds,
        "created_ms": now_ms() if created_ms is None else created_ms,
    }


# ---- decision plane: summaries and payload references --------------------------------------

RESPONSE_SUMMARY_FIELDS = ("prompt_id", "domain", "mode", "prompt", "ground_truth", "messages", "round",
                           "sample_index", "finish_reason", "error", "policy_version", "generation_ms", "created_ms")
TRAJECTORY_PAYLOAD_FIELDS = ("turns", "response_mask", "extras")


def payload_ref(topic: str, partition: int, offset: int, size_bytes: int = 0) -> dict:
    """A ``PayloadRef`` record: where a payload event was written."""
    return {"topic": topic, "partition": int(partition), "offset": int(offset), "size_bytes": int(size_bytes)}


def is_payload_ref(payload: Mapping) -> bool:
    """True for a ``PayloadRef`` (the payload still has to be fetched), False for an inline
    payload (an event written before references, read through schema history)."""
    return "offset" in payload and "topic" in payload


MEMBER_LISTS = ("responses", "trajectories")
"""The fields of a decided group that list its members (``Group``, ``TrajectoryGroup``)."""


def payload_members(value: Mapping | None) -> list[Mapping]:
    """The parts of a decoded event that name a payload (have a ``payload`` record): the event
    itself (``RewardedResponse``, ``TrajectorySummary``) or its members (``Group.responses``,
    ``TrajectoryGroup.trajectories``). Payload events, and anything else, have none."""
    if not isinstance(value, Mapping):
        return []
    if isinstance(value.get("payload"), Mapping):
        return [value]
    return [m for name in MEMBER_LISTS if isinstance(value.get(name), list)
            for m in value[name] if isinstance(m, Mapping) and isinstance(m.get("payload"), Mapping)]


def payload_refs(value: Mapping | None) -> list[Mapping]:
    """The ``PayloadRef`` records a decoded event names, in member order (inline payloads, from
    events written before references, need no fetch and are left out)."""
    return [m["payload"] for m in payload_members(value) if is_payload_ref(m["payload"])]


def response_summary(response: Mapping) -> dict:
    """The ``ResponseSummary`` of a ``Response`` record: its identity, lengths and finish reason,
    without token arrays or text."""
    summary = {k: response.get(k) for k in RESPONSE_SUMMARY_FIELDS}
    summary["mode"] = summary["mode"] or "train"
    summary["prompt"] = summary["prompt"] or ""
    summary["ground_truth"] = summary["ground_truth"] or ""
    summary["messages"] = list(summary["messages"] or [])
    summary["policy_version"] = int(summary["policy_version"] or 0)
    summary["generation_ms"] = float(summary["generation_ms"] or 0.0)
    summary["created_ms"] = int(summary["created_ms"] or 0)
    summary["prompt_length"] = len(response.get("prompt_token_ids", ()))
    summary["response_length"] = len(response.get("response_token_ids", ()))
    return summary


def trajectory_summary(trajectory: Mapping, payload: Mapping) -> dict:
    """The ``TrajectorySummary`` of a ``Trajectory`` record whose payload is ``payload`` (a
    ``PayloadRef``, or the trajectory itself for events read through schema history)."""
    summary = {k: v for k, v in trajectory.items() if k not in TRAJECTORY_PAYLOAD_FIELDS}
    turns = trajectory.get("turns") or []
    mask = trajectory.get("response_mask")
    mask = () if mask is None else mask
    summary.update(
        num_turns=len(turns),
        prompt_length=len(turns[0]["prompt_token_ids"]) if turns else 0,
        response_length=len(mask),
        model_tokens=int(sum(int(m) for m in mask)) if not hasattr(mask, "sum") else int(mask.sum()),
        payload=payload,
    )
    return summary


PROMPTS_END_KEY = b"__end__"

REWARD_PATTERNS = ("all_correct", "all_wrong", "mixed")
"""A decided group's ``PromptOutcome.reward_pattern`` (and ``PromptHistory`` entries): its kept
responses' rewards all > 0 and equal, all <= 0 and equal, or not all equal."""
"""The key of the ``PromptsEnd`` marker on ``prompts``."""


def prompts_end(prompts: int, producer: str = "") -> dict:
    """A ``PromptsEnd`` record: ``prompts`` were published before it and none follow."""
    return {"prompts": int(prompts), "producer": producer, "created_ms": now_ms()}
