"""PipelineConfig: the fields RLVR and agentic share are declared once, with one default, one
validation and the same YAML keys in both pipelines."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.config import AgenticConfig, PipelineConfig, RLVRConfig, load_config, parse_config
from rollstream.exceptions import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHARED = ["name", "seed", "pretrain", "base_dir", "kafka", "rollout_batch_size", "max_steps", "max_staleness", "min_fill_ratio",
          "time_limit_s", "batch_timeout_s", "max_stage_restarts", "stage_restart_backoff_s", "adv_estimator", "actor_infer", "actor_train",
          "train_infer_correction", "trainer"]
RLVR_KEYS = SHARED + ["num_return_sequences_in_group", "val_num_return_sequences", "max_running_prompts",
                      "max_additional_running_prompts", "oversample_by_yield", "max_response_rounds", "prompt_timeout_s",
                      "max_reissues_per_prompt", "max_prompts_per_batch",
                      "prompt_length", "num_epochs", "eval_steps", "history_filter", "rewards", "datasets", "domain_interleave_probs",
                      "reward_concurrency"]
AGENTIC_KEYS = SHARED + ["max_concurrent_episodes", "max_context_tokens", "train_env_manager", "val_env_manager",
                         "custom_envs"]


def rlvr(**overrides) -> dict:
    return {"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 4,
            "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": [], **overrides}


def agentic(**overrides) -> dict:
    return {"rollout_batch_size": 4, "custom_envs": {"lake": {"env_type": "frozen_lake"}},
            "train_env_manager": {"num_env_groups": 2, "group_size": 2, "tags": ["lake"]}, **overrides}


def test_both_pipelines_take_the_shared_fields_from_one_base():
    assert list(PipelineConfig.model_fields) == SHARED
    assert issubclass(RLVRConfig, PipelineConfig) and issubclass(AgenticConfig, PipelineConfig)
    for name in SHARED[1:]:  # name is the one default each pipeline sets itself
        base = repr(PipelineConfig.model_fields[name])  # annotation, default, bounds, description
        assert repr(RLVRConfig.model_fields[name]) == base == repr(AgenticConfig.model_fields[name])


def test_yaml_keys_are_unchanged():
    assert sorted(parse_config(rlvr()).model_dump()) == sorted(RLVR_KEYS)
    assert sorted(parse_config(agentic()).model_dump()) == sorted(AGENTIC_KEYS)


def test_shared_defaults_are_the_same_in_both_pipelines():
    r, a = parse_config(rlvr()), parse_config(agentic())
    assert (r.name, a.name) == ("rlvr", "agentic")
    for cfg in (r, a):
        assert (cfg.seed, cfg.max_steps, cfg.max_staleness, cfg.min_fill_ratio, cfg.time_limit_s) == (42, 1, None, 1.0, 900.0)
        assert (cfg.kafka.bootstrap_servers, cfg.kafka.topic_prefix, cfg.kafka.partitions) == (None, "rollstream.", 4)
        assert (cfg.actor_infer.backend, cfg.actor_infer.dtype, cfg.actor_infer.max_batch) == ("transformers", "float32", 16)
        assert (cfg.actor_train.lr, cfg.actor_train.micro_batch_size, cfg.actor_train.keep_checkpoints) == (1e-6, 4, 2)
        assert cfg.train_infer_correction.model_dump() == {
            "is_weight": {"enabled": False, "weight_type": "token", "upper_bound": 1.2, "detach": True},
            "filters": [], "mask_collapse_threshold": 0.5}
    shared = lambda cfg: {k: v for k, v in cfg.model_dump().items() if k in SHARED[1:]}  # noqa: E731
    assert shared(r) == {**shared(a), "rollout_batch_size": 2}


@pytest.mark.parametrize("make", [rlvr, agentic])
@pytest.mark.parametrize("field, value", [
    ("min_fill_ratio", 0.0), ("max_staleness", -1), ("time_limit_s", 0), ("max_steps", 0), ("rollout_batch_size", 0),
])
def test_shared_validation_applies_to_both_pipelines(make, field, value):
    with pytest.raises(ConfigError, match=rf"^invalid config: {field}: "):
        parse_config(make(**{field: value}))


@pytest.mark.parametrize("make", [rlvr, agentic])
def test_an_unknown_key_is_rejected_in_both_pipelines(make):
    with pytest.raises(ConfigError, match="max_stalenes: Extra inputs are not permitted"):
        parse_config(make(max_stalenes=1))


@pytest.mark.parametrize("example", ["rlvr_math.yaml", "agentic_frozenlake.yaml"])
def test_a_dumped_config_parses_back_to_itself(example):
    cfg = load_config(ROOT / "examples" / example)
    assert parse_config(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("kafka, match", [
    ({"max_message_bytes": 2048}, "kafka.max_message_bytes: Input should be greater than or equal to 1048576"),
    ({"compression_type": "snappy"}, "kafka.compression_type"),
    ({"payload_retention_ms": -5}, "kafka.payload_retention_ms"),
])
def test_payload_settings_are_checked_where_the_config_loads(kafka, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(rlvr(kafka=kafka))


def test_a_group_completes_within_its_timeouts_and_a_short_payload_retention_is_allowed():
    # RLVR: 60 s a round x (3 rounds + 1 reissue) = 240 s; agentic: 100 s x (1 + 1 reissue + 2 refills) = 400 s
    rlvr_args = dict(prompt_timeout_s=60, max_response_rounds=3, max_reissues_per_prompt=1)
    config = parse_config(rlvr(kafka={"payload_retention_ms": 1_000}, **rlvr_args))  # the trainer keeps what is pending
    assert (config.group_completion_s, config.kafka.payload_retention_ms) == (240, 1_000)
    screened = {"math": {"reward_type": "gsm8k", "screening": {"samples": 2},
                         "query_filter_config": {"type": "mean_filter"}}}
    assert parse_config(rlvr(rewards=screened, **rlvr_args)).group_completion_s == 300  # + the screening round
    manager = {"num_env_groups": 2, "group_size": 2, "tags": ["lake"], "episode_timeout_s": 100,
               "max_reissues_per_episode": 1, "refill": {"max_refills_per_group": 2}}
    assert parse_config(agentic(train_env_manager=manager)).group_completion_s == 400
    no_refill = {**manager, "refill": {"enabled": False}}
    assert parse_config(agentic(train_env_manager=no_refill)).group_completion_s == 200


def test_a_topic_retention_shorter_than_a_group_may_take_is_refused_with_the_numbers():
    rlvr_args = dict(prompt_timeout_s=60, max_response_rounds=3, max_reissues_per_prompt=1)
    with pytest.raises(ConfigError) as info:
        parse_config(rlvr(kafka={"topic_configs": {"groups.accepted": {"retention.ms": 239_000}}}, **rlvr_args))
    assert str(info.value) == (
        "invalid config: kafka.topic_configs.groups.accepted.retention.ms 239000 (239 s) is shorter than a group may "
        "take to complete: 240 s (prompt_timeout_s 60 x (max_response_rounds 3 + max_reissues_per_prompt 1)); the "
        "broker would delete records an open group still needs. Raise it, or leave it out: payloads are deleted by "
        "the trainer once no group needs them (kafka.payload_retention_ms)")
    for fine in (240_000, -1):
        parse_config(rlvr(kafka={"topic_configs": {"responses": {"retention.ms": fine}}}, **rlvr_args))
    parse_config(rlvr(kafka={"topic_configs": {"metrics": {"retention.ms": 1_000}}}, **rlvr_args))  # no group reads it
    manager = {"num_env_groups": 2, "group_size": 2, "tags": ["lake"], "episode_timeout_s": 100,
               "max_reissues_per_episode": 1, "refill": {"max_refills_per_group": 0}}
    with pytest.raises(ConfigError, match=r"trajectories.retention.ms 199000 \(199 s\) is shorter than a group may take "
                                          r"to complete: 200 s \(train_env_manager.episode_timeout_s 100 x \(1 \+ "
                                          r"max_reissues_per_episode 1 \+ refill.max_refills_per_group 0\)\)"):
        parse_config(agentic(kafka={"topic_configs": {"trajectories": {"retention.ms": 199_000}}},
                             train_env_manager=manager))


def test_payload_settings_default_to_a_64k_token_response_with_room_to_spare():
    kafka = parse_config(rlvr()).kafka
    assert (kafka.max_message_bytes, kafka.compression_type, kafka.payload_retention_ms) == (16 * 1024 * 1024, "lz4", None)


def test_experiment_trackers_are_off_by_default_and_named_once_each():
    for cfg in (parse_config(rlvr()), parse_config(agentic())):
        assert cfg.trainer.model_dump() == {"loggers": [], "log_dir": None, "project": "rollstream"}
    assert parse_config(rlvr(trainer={"loggers": "wandb"})).trainer.loggers == ["wandb"]  # one name: a list
    assert parse_config(rlvr(trainer={"loggers": ["console", "tensorboard", "wandb", "mlflow"]})).trainer.loggers == [
        "console", "tensorboard", "wandb", "mlflow"]
    for loggers, problem in ((["nope"], "trainer.loggers.0: unknown trainer.loggers 'nope'; valid: ['console', 'mlflow', "
                                        "'tensorboard', 'wandb'] or an import path 'pkg.module:name'"),
                             (["wandb", "wandb"], "trainer.loggers: a logger is listed twice")):
        with pytest.raises(ConfigError) as info:
            parse_config(rlvr(trainer={"loggers": loggers}))
        assert problem in str(info.value)
