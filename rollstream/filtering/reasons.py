"""One taxonomy of rejection reasons, at every unit (prompt, response, group, batch)."""

from __future__ import annotations

from enum import Enum


class RejectReason(str, Enum):
    # prompt level (admission, before generation)
    PROMPT_TOO_LONG = "prompt_too_long"
    # response level
    ENGINE_ERROR = "engine_error"
    TRUNCATED = "truncated"
    EMPTY_RESPONSE = "empty_response"
    INVALID_FORMAT = "invalid_format"
    INVALID_REWARD = "invalid_reward"
    CUSTOM_RESPONSE_FILTER = "custom_response_filter"
    # prompt transaction
    RESPONSE_RETRIES_EXHAUSTED = "response_retries_exhausted"
    # query (group) level
    MEAN_TOO_LOW = "mean_too_low"
    MEAN_TOO_HIGH = "mean_too_high"
    ZERO_STD = "zero_std"
    CUSTOM_QUERY_FILTER = "custom_query_filter"
    FILTER_ERROR = "filter_error"  # a custom filter raised: the group is kept, as rejected data
    # agentic trajectory / group level
    ENV_TIMEOUT = "env_timeout"  # an environment step outlived env_step_timeout_s
    ENV_FAILED = "env_failed"  # the environment raised
    INFRA_ABORT = "infra_abort"  # one trajectory set aside (env_timeout/env_failed), refilled
    INVALID_TRAJECTORY = "invalid_trajectory"  # token arrays that disagree: cannot be trained
    REFILL_EXHAUSTED = "refill_exhausted"  # too few valid trajectories left after the refills
    EPISODE_TIMEOUT = "episode_timeout"  # runs still missing after the deadline and its reissues
    DROP_FLAG = "drop_flag"  # the drop_flag group filter dropped the group
    GROUP_FILTER = "group_filter"  # a group filter returned True (drop) without naming a reason
    # batch level
    BATCH_UNDERFILLED = "batch_underfilled"

    def __str__(self) -> str:
        return self.value


ACCEPTED = "accepted"
