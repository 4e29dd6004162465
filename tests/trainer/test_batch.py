"""Pure tests of rollstream.trainer.batch: padding layout, GRPO advantages, validation."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.trainer.batch import RolloutBatch, build_batch, check_group, grpo_advantages

PAD = 0


def rewarded(prompt_id, sample_index, prompt, tokens, logprobs, reward, version=0):
    """A decoded RewardedResponse record with only the fields the batch reads filled in."""
    return {
        "response": {
            "prompt_id": prompt_id, "domain": "math", "mode": "train", "prompt": "q",
            "ground_truth": "", "round": 0, "sample_index": sample_index,
            "prompt_token_ids": list(prompt), "response_token_ids": list(tokens),
            "infer_logprobs": list(logprobs), "response_text": "", "finish_reason": "stop",
            "error": None, "policy_version": version, "generation_ms": 0.0, "created_ms": 0,
        },
        "response_level_reward": reward,
        "scores": {}, "meta": {}, "reward_error": None, "reward_ms": 0.0,
    }


def group(key, responses, prompt=()):
    return {"group_key": key, "prompt_id": key, "prompt_token_ids": list(prompt),
            "responses": responses}


@pytest.fixture
def two_groups():
    # group "a": prompt of 3 tokens, 2 responses given out of sample_index order
    a = group("a", [
        rewarded("a", 1, [11, 12, 13], [21], [-0.5], 0.0, version=3),
        rewarded("a", 0, [11, 12, 13], [31, 32, 33], [-0.1, -0.2, -0.3], 1.0, version=2),
    ])
    # group "b": prompt of 1 token, 2 responses
    b = group("b", [
        rewarded("b", 0, [14], [41, 42], [-1.0, -2.0], 1.0, version=3),
        rewarded("b", 1, [14], [], [], 1.0, version=3),
    ])
    return [a, b]


def test_build_batch_pads_prompts_left_and_responses_right(two_groups):
    batch = build_batch(two_groups, step=7, pad_token_id=PAD)

    assert isinstance(batch, RolloutBatch)
    assert torch.equal(batch.prompt_ids, torch.tensor(
        [[11, 12, 13], [11, 12, 13], [0, 0, 14], [0, 0, 14]], dtype=torch.int64))
    assert torch.equal(batch.prompt_mask, torch.tensor(
        [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]], dtype=torch.int64))
    assert torch.equal(batch.response_ids, torch.tensor(
        [[31, 32, 33], [21, 0, 0], [41, 42, 0], [0, 0, 0]], dtype=torch.int64))
    assert torch.equal(batch.response_mask, torch.tensor(
        [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float32))
    assert torch.equal(batch.infer_logprobs, torch.tensor(
        [[-0.1, -0.2, -0.3], [-0.5, 0, 0], [-1.0, -2.0, 0], [0, 0, 0]], dtype=torch.float32))
    assert torch.equal(batch.response_level_rewards, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert torch.equal(batch.group_index, torch.tensor([0, 0, 1, 1], dtype=torch.int64))
    assert batch.group_keys == ["a", "b"]
    assert batch.prompt_ids_str == ["a", "a", "b", "b"]
    assert batch.sample_index == [0, 1, 0, 1]
    assert batch.policy_versions == [2, 3, 3, 3]
    assert batch.step == 7
    assert (batch.batch_size, batch.num_groups, batch.responses_per_group) == (4, 2, [2, 2])


def test_build_batch_broadcasts_advantage_over_valid_tokens_only(two_groups):
    batch = build_batch(two_groups, step=0, pad_token_id=PAD)
    # group a: rewards [1, 0], mean 0.5, unbiased std sqrt(0.5); group b is constant -> 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor(
        [[a, a, a], [-a, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.float32)
    assert batch.advantages.dtype == torch.float32
    torch.testing.assert_close(batch.advantages, expected)
    assert torch.all(batch.advantages[batch.response_mask == 0] == 0)


def test_build_batch_uses_group_prompt_tokens_when_response_has_none():
    g = group("g", [rewarded("g", 0, [], [5], [-1.0], 1.0)], prompt=[7, 8])
    batch = build_batch([g], step=0, pad_token_id=99)
    assert batch.prompt_ids.tolist() == [[7, 8]]
    assert batch.advantages.tolist() == [[0.0]]  # group of one


def test_build_batch_pads_with_given_token_id(two_groups):
    batch = build_batch(two_groups, step=0, pad_token_id=-7)
    assert batch.prompt_ids[2].tolist() == [-7, -7, 14]
    assert batch.response_ids[3].tolist() == [-7, -7, -7]


def test_build_batch_rejects_empty_group_list():
    with pytest.raises(ValueError, match="at least one group"):
        build_batch([], step=0, pad_token_id=PAD)


def test_build_batch_rejects_group_without_responses(two_groups):
    with pytest.raises(ValueError, match="'empty' has no responses"):
        build_batch([two_groups[0], group("empty", [])], step=0, pad_token_id=PAD)


def test_build_batch_rejects_logprob_token_length_mismatch():
    g = group("m", [rewarded("m", 0, [1], [5, 6], [-1.0], 1.0)])
    with pytest.raises(ValueError, match="2 response tokens but 1 infer_logprobs"):
        build_batch([g], step=0, pad_token_id=PAD)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_group_rejects_non_finite_reward(bad):
    g = group("n", [rewarded("n", 0, [1], [5], [-1.0], bad),
                    rewarded("n", 1, [1], [5], [-1.0], 1.0)])
    with pytest.raises(ValueError, match="non-finite response_level_reward"):
        check_group(g)


def test_check_group_rejects_repeated_sample_index():
    g = group("d", [rewarded("d", 0, [1], [5], [-1.0], 1.0),
                    rewarded("d", 0, [1], [6], [-1.0], 0.0)])
    with pytest.raises(ValueError, match="sample_index 0 appears twice"):
        check_group(g)


def test_grpo_advantages_match_hand_computed_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # row 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # row 1: mean 0.5,  unbiased std sqrt(4 * 0.25 / 3) = 1 / sqrt(3)
    s0, s1 = 0.5 + 1e-6, 1 / math.sqrt(3) + 1e-6
    expected = torch.tensor([
        [0.75 / s0, -0.25 / s0, -0.25 / s0, -0.25 / s0],
        [0.5 / s1, 0.5 / s1, -0.5 / s1, -0.5 / s1],
    ])
    torch.testing.assert_close(grpo_advantages(rewards), expected)
    torch.testing.assert_close(grpo_advantages(rewards)[0], torch.tensor([1.5, -0.5, -0.5, -0.5]),
                               atol=1e-5, rtol=0)


def test_grpo_advantages_without_std_normalisation_only_centre():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(grpo_advantages(rewards, norm_by_std=False),
                               torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_grpo_advantage_of_group_of_one_is_zero():
    assert grpo_advantages(torch.tensor([[0.7], [-3.0]])).tolist() == [[0.0], [0.0]]
    assert [a.tolist() for a in grpo_advantages([torch.tensor([5.0])])] == [[0.0]]


@pytest.mark.parametrize("n, value", [(4, 0.0), (4, 1.0), (3, 0.9), (6, 2.1), (7, 0.1)])
def test_grpo_advantage_of_all_equal_group_is_exactly_zero(n, value):
    # (3, 0.9), (6, 2.1), (7, 0.1): float32 rounding of the mean leaves r - mean != 0, so the
    # plain formula gives |A| up to 0.19 here; a constant group must carry no signal at all
    out = grpo_advantages(torch.full((2, n), value))
    assert torch.equal(out, torch.zeros(2, n))


def test_grpo_advantages_handle_groups_of_unequal_size():
    groups = [torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([2.0])]
    out = grpo_advantages(groups)
    assert [a.shape for a in out] == [(4,), (2,), (1,)]
    torch.testing.assert_close(out[0], grpo_advantages(groups[0][None])[0])
    s = math.sqrt(0.5) + 1e-6
    torch.testing.assert_close(out[1], torch.tensor([0.5 / s, -0.5 / s]))
    assert out[2].tolist() == [0.0]


def test_grpo_ragged_equals_vectorised_over_seeded_shapes():
    gen = torch.Generator().manual_seed(0)
    for n in (2, 3, 8, 16):
        rewards = torch.randint(0, 3, (5, n), generator=gen).float()
        ragged = torch.stack(grpo_advantages(list(rewards)))
        torch.testing.assert_close(ragged, grpo_advantages(rewards))


def test_grpo_advantages_cast_integer_rewards_to_float32():
    out = grpo_advantages(torch.tensor([[1, 0]]))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_grpo_advantages_reject_non_finite_rewards(bad):
    with pytest.raises(ValueError, match="non-finite reward"):
        grpo_advantages(torch.tensor([[1.0, 0.0], [bad, 0.0]]))
    with pytest.raises(ValueError, match="group 1"):
        grpo_advantages([torch.tensor([1.0]), torch.tensor([0.0, bad])])


def test_grpo_advantages_reject_wrong_rank():
    with pytest.raises(ValueError, match=r"\(G, n\)"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


def test_rollout_batch_to_moves_every_tensor(two_groups):
    batch = build_batch(two_groups, step=3, pad_token_id=PAD).to("cpu")
    assert batch.step == 3 and batch.advantages.device.type == "cpu"
