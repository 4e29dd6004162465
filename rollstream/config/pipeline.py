"""The fields both pipelines (RLVR and agentic) share, declared once."""

from __future__ import annotations


from pydantic import Field, field_validator

from rollstream.config.base import ActorInferConfig, ActorTrainConfig, FrozenModel, KafkaConfig, TrainerConfig, builtins
from rollstream.config.corrections import TrainInferCorrectionConfig
from rollstream.config.model_paths import check_model_path
from rollstream.filtering.decision import config_hash
from rollstream.extensions import ADV_ESTIMATORS


NOT_NEEDED_BY_A_GROUP = ("metrics", "dead-letter", "groups.rejected")
"""Topics no open or untrained group reads: any retention suits them."""


def check_topic_retention(topic_configs: dict[str, dict], completion_s: float, bound: str) -> None:
    """Raise ValueError when ``kafka.topic_configs`` gives a topic a ``retention.ms`` shorter than
    ``completion_s``, the longest a group may take to complete (``bound`` says how it is reached):
    the broker would delete records (requests, payloads, rewarded responses, decisions) that a
    group still open or not yet trained needs. ``NOT_NEEDED_BY_A_GROUP`` are not checked."""
    for topic, configs in sorted(topic_configs.items()):
        if topic in NOT_NEEDED_BY_A_GROUP:
            continue
        retention = configs.get("retention.ms")
        if retention is None or float(retention) < 0 or float(retention) >= completion_s * 1000:
            continue
        raise ValueError(f"kafka.topic_configs.{topic}.retention.ms {retention} ({float(retention) / 1000:g} s) is shorter "
                         f"than a group may take to complete: {completion_s:g} s ({bound}); the broker would delete "
                         "records an open group still needs. Raise it, or leave it out: payloads are deleted by "
                         "the trainer once no group needs them (kafka.payload_retention_ms)")


class PipelineConfig(FrozenModel):
    """Run identity, Kafka, batch target and bounds, and the inference/training settings of a
    pipeline. RLVRConfig and AgenticConfig add their own stages; each sets its ``name`` default.
    Pydantic lists these fields first in ``model_dump`` and in validation errors."""

    # each pipeline sets its default name
    name: str = Field(..., description="The run's name: its folder runs/<name> and its trackers' run name.")
    seed: int = Field(42, description="Seeds the prompt order, each generation request's sampling and the trainer.")
    pretrain: str | None = Field(
        None, description="The policy model of both roles (reference name): a local Hugging Face folder or a hub "
                          "id in the local cache; actor_infer/actor_train.model_args.model_name_or_path override "
                          "it per role. null: the bundled SmolLM2-135M-Instruct.")
    base_dir: str | None = Field(
        None, description="The folder a config file's relative paths resolve against before the working directory: "
                          "its file sources (datasets[].source) and the modules of its import paths (reward_type, "
                          "filters, ...). Set to the file's own folder when it is loaded; the config a run writes "
                          "for its stages keeps it.")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig, description="The cluster, topics and client settings.")
    rollout_batch_size: int = Field(
        ..., gt=0, description="Per trainer batch: groups (prompts) in RLVR; trajectories in agentic, a multiple of "
                               "train_env_manager.group_size.")
    max_steps: int = Field(1, gt=0, description="Trainer batches to build, then stop.")
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Policy versions a group may lag the newest published one; older groups are rejected 'stale'. "
                    "RLVR's admission starts step s only once version s - max_staleness exists (0 = on-policy). "
                    "null = unbounded.")
    min_fill_ratio: float = Field(
        1.0, gt=0.0, le=1.0,
        description="An underfilled batch (RLVR: the resampling budget is spent; agentic: every group id is spent) "
                    "ships partial if accepted/target >= this, else the run fails.")
    time_limit_s: float = Field(900.0, gt=0, description="Wall-clock bound of `rollstream run`.")
    batch_timeout_s: float | None = Field(
        1800.0, gt=0, description="The trainer (rollstream run's, `rollstream worker trainer`, RolloutStream.from_config) "
                                  "ends timed_out when no accepted group, batch or verdict has come for this long: a "
                                  "stalled pipeline. null: wait without bound.")
    max_stage_restarts: int = Field(
        3, ge=0, le=100, description="`rollstream run`: a stage process that dies is restarted (from its committed "
                                     "offsets and changelog state) up to this many times per stage; one more death "
                                     "ends the run stage_failed.")
    stage_restart_backoff_s: float = Field(
        1.0, ge=0.0, le=600.0, description="`rollstream run`: wait before a stage's first restart, doubled for each "
                                           "later one.")
    adv_estimator: str = Field(
        "grpo", description=f"Advantage of each response from its group's rewards, {builtins(ADV_ESTIMATORS)}: "
                            "grpo (r - mean) / (std + eps); "
                            "dr_grpo r - mean (Dr. GRPO, no std normalisation); rloo r - mean of the others "
                            "(leave-one-out); or an import path 'pkg.module:fn' of your own, "
                            "fn(centred, rewards, eps) -> advantages on (G, n) tensors. "
                            "rollstream.trainer.batch.group_advantages.")
    actor_infer: ActorInferConfig = Field(default_factory=ActorInferConfig, description="Generation: engine, model, "
                                          "sampling.")
    actor_train: ActorTrainConfig = Field(default_factory=ActorTrainConfig, description="Training: model, optimiser, "
                                          "the GRPO step, checkpoints.")
    train_infer_correction: TrainInferCorrectionConfig = Field(
        default_factory=TrainInferCorrectionConfig, description="The train-inference mismatch correction: IS weight "
                                                                "and token filters.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The trainer process: experiment "
                                   "trackers and their folder.")

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        if name not in ADV_ESTIMATORS:
            ADV_ESTIMATORS.get_named(name)  # an import path: imported now, so a typo fails at start-up
        return name

    @field_validator("pretrain")
    @classmethod
    def _pretrain_exists(cls, value: str | None) -> str | None:
        # Checked on the files (rollstream.config.model_paths): a missing or incomplete folder is a
        # config error naming `pretrain`, before any process starts; never a silent fallback.
        return check_model_path(value)

    @property
    def infer_model_path(self) -> str | None:
        """The generation model as configured (``actor_infer.model_args.model_name_or_path``, else
        ``pretrain``); None: the bundled model. rollstream.policy.model.resolve_model_path makes
        it a folder."""
        return self.actor_infer.model_args.model_name_or_path or self.pretrain

    @property
    def train_model_path(self) -> str | None:
        """The training model as configured (``actor_train.model_args.model_name_or_path``, else
        ``pretrain``); None: the bundled model."""
        return self.actor_train.model_args.model_name_or_path or self.pretrain

    def filter_config_json(self, key: str) -> str:
        """What decides a group of ``key`` (an RLVR domain, an agentic mode): each pipeline's own."""
        raise NotImplementedError

    def filter_config_hash(self, key: str) -> str:
        """The ``filter_config_hash`` of ``key``'s groups: config_hash of ``filter_config_json(key)``."""
        return config_hash(self.filter_config_json(key))
