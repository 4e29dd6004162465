"""The agentic pipeline's config: env groups -> env workers -> group queue -> trainer. Keys
follow the reference's agentic YAML (train_env_manager, val_env_manager, custom_envs)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, model_validator

from rollstream.config.base import FrozenModel, builtins, extension
from rollstream.config.pipeline import PipelineConfig, check_topic_retention
from rollstream.extensions import ENVIRONMENTS, GROUP_FILTERS

EnvType = extension(ENVIRONMENTS)
GroupFilterName = extension(GROUP_FILTERS)


class EnvConfig(FrozenModel):
    """One ``custom_envs`` entry: an environment and how a trajectory in it is played."""

    env_type: EnvType = Field(..., description=f"{builtins(ENVIRONMENTS)}, or the import path 'pkg.module:Class' of yours, built as Class(**env_config).")
    env_config: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments of the environment.")
    max_actions_per_traj: int = Field(5, gt=0, le=1000, description="Model turns per trajectory at most.")
    max_tokens_per_step: int = Field(32, gt=0, le=32768, description="New tokens per model turn at most.")
    env_step_timeout_s: float = Field(30.0, gt=0, description="A reset/step slower than this ends the trajectory with env_timeout.")
    format_penalty: float = Field(0.0, le=0.0, description="Added to the return for every action that fails to parse.")


class RefillConfig(FrozenModel):
    """Per-sample refill of infra-aborted trajectories (an infra failure is never reward 0)."""

    enabled: bool = Field(True, description="Set env_timeout/env_failed trajectories aside (reason infra_abort) and start a replacement run with the same seed. False: they stay group members and the group filter sees them (the reference's behaviour).")
    max_refills_per_group: int = Field(2, ge=0, le=1000, description="Replacement runs per episode at most.")
    min_valid_group_size: int | None = Field(None, gt=0, description="When the refills are spent: accept a group of at least this many valid trajectories (advantages over those); null = group_size, i.e. drop with reason refill_exhausted.")


class EnvManagerConfig(FrozenModel):
    """``train_env_manager`` / ``val_env_manager``: the env groups of one mode."""

    num_env_groups: int = Field(..., ge=0, le=100_000, description="Group ids 0 .. num_env_groups-1; each plays its own episodes.")
    group_size: int = Field(..., gt=0, le=1024, description="Trajectories per group (the GRPO group).")
    group_size_redundancy: int = Field(0, ge=0, le=1024, description="Extra runs started per episode; the first group_size to finish form the group.")
    tags: list[str] = Field(..., min_length=1, description="custom_envs entries the groups play.")
    num_groups_partition: list[int] | None = Field(None, description="Groups per tag (sums to num_env_groups); default: as even as possible.")
    max_traj_per_env: int = Field(1, gt=0, le=1024, description="Episodes each group id keeps open at once, and accepts per training step.")
    group_filter_cls: GroupFilterName = Field("default", description=f"The group filter: a built-in ({builtins(GROUP_FILTERS)}) or the import path 'pkg.module:Class' of yours, built as Class(config, env_manager_config, mode). Its filter(group_id, episode_id, group) returns True to DROP the group (then a new episode replaces it) and False to keep it.")
    group_filter_config: dict[str, Any] = Field(default_factory=dict, description="Arguments the built-in group filters read (std_threshold, max_ratio, ratio_mode, window, drop_in_val).")
    max_replaced_episodes: int = Field(8, ge=0, le=100_000, description="Replacement episodes per group id at most; then the group id stops (bounded resampling).")
    episode_timeout_s: float = Field(600.0, gt=0, description="Runs still missing this long after an episode started are reissued.")
    max_reissues_per_episode: int = Field(1, ge=0, le=100, description="Deadline reissues per episode; after the last one the episode is dropped (episode_timeout).")
    refill: RefillConfig = Field(default_factory=RefillConfig, description="Replacement runs for trajectories "
                                 "an infrastructure failure ended.")

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
        """Runs started per episode: ``group_size + group_size_redundancy``."""
        return self.group_size + self.group_size_redundancy

    @property
    def runs_in_turn(self) -> int:
        """How many runs of one trajectory may follow each other: the first, each deadline
        reissue, each refill; each may take ``episode_timeout_s``."""
        return 1 + self.max_reissues_per_episode + (self.refill.max_refills_per_group if self.refill.enabled else 0)


class AgenticConfig(PipelineConfig):
    """The agentic pipeline: the shared fields (PipelineConfig) plus env workers, env managers
    and environments."""

    name: str = Field("agentic", description="The run's name: its folder runs/<name> and its trackers' run name.")
    max_concurrent_episodes: int = Field(16, gt=0, le=4096, description="Trajectories one env worker plays at once (their turns are generated as one batch).")
    max_context_tokens: int = Field(2048, gt=0, le=1_000_000, description="Tokens of a trajectory's context at most; a turn that would pass it ends the run (stop_reason max_length).")
    train_env_manager: EnvManagerConfig = Field(..., description="The env groups that play train episodes.")
    val_env_manager: EnvManagerConfig | None = Field(None, description="The env groups that play validation "
                                                     "episodes (never trained on); null: none.")
    custom_envs: dict[str, EnvConfig] = Field(..., description="Environments by tag (the env managers' tags).")

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
        mode, m = max(self.env_managers().items(), key=lambda kv: kv[1].episode_timeout_s * kv[1].runs_in_turn)
        check_topic_retention(self.kafka.topic_configs, self.group_completion_s,
                              f"{mode}_env_manager.episode_timeout_s {m.episode_timeout_s:g} x (1 + max_reissues_per_episode "
                              f"{m.max_reissues_per_episode} + refill.max_refills_per_group "
                              f"{m.runs_in_turn - 1 - m.max_reissues_per_episode})")
        return self

    @property
    def group_completion_s(self) -> float:
        """The longest a group's payloads wait for its decision (seconds): each run of an
        episode (the first, each deadline reissue, each refill) may take ``episode_timeout_s``."""
        return max(m.episode_timeout_s * m.runs_in_turn for m in self.env_managers().values())

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

    @property
    def groups_per_batch(self) -> int:
        """Groups per trainer batch: ``rollout_batch_size // train_env_manager.group_size``."""
        return self.rollout_batch_size // self.train_env_manager.group_size

    def episodes_per_group(self, mode: str) -> int:
        """Accepted episodes each group id of ``mode`` delivers in total."""
        manager = self.env_managers()[mode]
        return manager.max_traj_per_env * (self.max_steps if mode == "train" else 1)

    def group_seed(self, mode: str, group_id: int) -> int:
        """Deterministic seed shared by every run of group ``group_id``; episode e plays
        ``group_seed + e`` (the reference system draws it at random instead)."""
        digest = hashlib.sha256(f"{self.seed}/{mode}/{group_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little") % 1_000_000
