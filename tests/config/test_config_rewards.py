"""`rewards.<domain>.reward_type` as an import path: checked when the config loads."""

from __future__ import annotations

import os
import re

import pytest

from rollstream.config import parse_config
from rollstream.exceptions import ConfigError

# the hint of a module that is not found (rollstream.registry.import_object)
LOOKED_UP = f" (looked up beside the config file, in the working directory {os.getcwd()} and in the installed packages)"

USER = "tests.workers.user_rewards"


def config(**domain) -> dict:
    return {"name": "m", "rollout_batch_size": 1, "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4,
            "datasets": [], "rewards": {"mine": domain}}


def test_import_path_with_its_timeout_batched_form_and_pool_size():
    cfg = parse_config({**config(reward_type=f"{USER}:batched", reward_timeout_s=2.5, reward_batched=True),
                        "reward_concurrency": 3})
    mine = cfg.rewards["mine"]
    assert (mine.reward_type, mine.reward_timeout_s, mine.reward_batched) == (f"{USER}:batched", 2.5, True)
    assert cfg.reward_concurrency == 3
    defaults = parse_config(config(reward_type="gsm8k"))
    assert (defaults.rewards["mine"].reward_timeout_s, defaults.rewards["mine"].reward_batched) == (30.0, False)
    assert defaults.reward_concurrency == 4


@pytest.mark.parametrize("reward_type, batched, message", [
    ("no_such_pkg.rewards:exact_match", False,
     "cannot import reward_type 'no_such_pkg.rewards:exact_match': module 'no_such_pkg.rewards': "
     f"ModuleNotFoundError: No module named 'no_such_pkg'{LOOKED_UP}"),
    (f"{USER}:nope", False, f"cannot import reward_type '{USER}:nope': module '{USER}' has no attribute 'nope'"),
    (f"{USER}:NOT_A_FUNCTION", False, f"reward_type '{USER}:NOT_A_FUNCTION' is not callable (int)"),
    ("exact_match", False, "reward_type 'exact_match' is neither a built-in ['gsm8k', 'math', 'reasoning_gym'] "
                           "nor an import path 'pkg.module:function'"),
    (f"{USER}:", False, f"reward_type '{USER}:' is not an import path 'pkg.module:attr'"),
    (f"{USER}:two_args", False, f"reward_type '{USER}:two_args' cannot be called as "
                                "(response_text, ground_truth, **info): too many positional arguments"),
    (f"{USER}:exact_match", True, f"reward_type '{USER}:exact_match' cannot be called as "
                                  "(response_texts, ground_truths, infos): too many positional arguments"),
    (f"{USER}:lambda_reward", False, f"reward_type '{USER}:lambda_reward' must be a module-level function"),
])
def test_bad_reward_type_fails_at_load(reward_type, batched, message):
    with pytest.raises(ConfigError, match=re.escape(f"rewards.mine: {message}")):
        parse_config(config(reward_type=reward_type, reward_batched=batched))


def test_metric_any_named_score_of_a_user_function_only():
    for metric in ("acc", "score", "f1"):
        cfg = parse_config(config(reward_type=f"{USER}:exact_match", query_filter_config={"metric": metric}))
        assert cfg.domain_filters()["mine"].metric == metric
    with pytest.raises(ConfigError, match="query_filter_config.metric 'f1' is not a reward field"):
        parse_config(config(reward_type="gsm8k", query_filter_config={"metric": "f1"}))


def test_timeout_and_concurrency_must_be_positive():
    with pytest.raises(ConfigError, match="rewards.mine.reward_timeout_s"):
        parse_config(config(reward_type=f"{USER}:exact_match", reward_timeout_s=0))
    with pytest.raises(ConfigError, match="reward_concurrency"):
        parse_config({**config(reward_type="gsm8k"), "reward_concurrency": 0})


MEAN01 = {"type": "mean_filter", "metric": "acc", "filter_args": {"threshold_down": 0.0, "threshold_up": 1.0}}


def screened(samples, query=MEAN01, n: int = 4) -> dict:
    return {**config(reward_type="gsm8k", query_filter_config=query, screening=samples),
            "num_return_sequences_in_group": n}


def test_screening_reaches_the_domain_filters_and_the_recorded_filter_config():
    cfg = parse_config(screened({"samples": 2, "diagnose": True}))
    f = cfg.domain_filters()["mine"]
    assert (f.screening_samples, f.screening_diagnose, f.first_round("train")) == (2, True, 2)
    assert '"screening": {"diagnose": true, "samples": 2}' in cfg.filter_config_json("mine")
    off = parse_config(config(reward_type="gsm8k", query_filter_config=MEAN01))
    assert off.domain_filters()["mine"].screening_samples == 0
    assert "screening" not in off.filter_config_json("mine")  # unchanged: the same hash as before screening


@pytest.mark.parametrize("samples, query, message", [
    ({"samples": 4}, MEAN01, "invalid config: rewards.mine.screening.samples: 4 must be below "
                             "num_return_sequences_in_group (4)"),
    ({"samples": 9}, MEAN01, "invalid config: rewards.mine.screening.samples: 9 must be below"),
    ({"samples": 1}, MEAN01, "invalid config: rewards.mine.screening.samples: must be >= 2 "
                             "(one sample has no variance to judge), got 1"),
    ({"samples": 0}, MEAN01, "rewards.mine.screening.samples: must be >= 2"),
    ({"samples": -3}, MEAN01, "rewards.mine.screening.samples: must be >= 2"),
    ({}, MEAN01, "rewards.mine.screening.samples: Field required"),
    ({"samples": 2}, {"type": "no_filter"}, "rewards.mine: screening: needs a query filter that k "
                                            "equal samples can decide (mean_filter or std_filter), got 'no_filter'"),
    ({"samples": 2}, {"type": "tests.filtering.test_query_filters:keep_if_any_perfect"}, "screening: needs a query filter"),
])
def test_absurd_screening_is_a_one_line_error_naming_the_key(samples, query, message):
    with pytest.raises(ConfigError) as err:
        parse_config(screened(samples, query))
    assert message in str(err.value) and "\n" not in str(err.value)
