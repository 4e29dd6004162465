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
        status: ``underfilled`` (admission), ``complete``, ``partial`` or ``recovered`` (trainer).
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
