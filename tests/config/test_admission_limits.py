"""The admission's limits come from the RLVR config, num_epochs and seed included."""

from __future__ import annotations

import pytest

from rollstream.config import parse_config
from rollstream.exceptions import ConfigError

BASE = {"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 4,
        "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": [], "seed": 7}


def test_num_epochs_and_seed_reach_the_admission_limits():
    assert parse_config(BASE).num_epochs == 1
    lim = parse_config({**BASE, "num_epochs": 3}).admission_limits()
    assert (lim.num_epochs, lim.seed, lim.rollout_batch_size, lim.max_prompts_per_batch) == (3, 7, 2, 4)


def test_num_epochs_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="num_epochs"):
        parse_config({**BASE, "num_epochs": 0})
