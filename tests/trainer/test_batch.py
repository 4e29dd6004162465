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


# -- agentic trajectory groups ------------------------------------------------------------------


def turn(prompt, tokens, logprobs):
    """A decoded Turn record with only the fields the batch reads filled in."""
    return {"prompt_token_ids": list(prompt), "response_token_ids": list(tokens),
            "infer_logprobs": list(logprobs), "response_text": "", "action": "",
            "invalid_move": False, "step_reward": 0.0, "finish_reason": "stop", "env_ms": 0.0}


def trajectory(traj_index, turns, mask, reward, version=0):
    """A decoded Trajectory record; ``mask`` is its flattened response_mask."""
    return {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": traj_index, "tag": "",
            "env_type": "sokoban", "seed": 0, "turns": turns, "response_mask": list(mask),
            "step_rewards": [], "response_level_rewards": reward, "success": False,
            "stop_reason": "done", "env_timeout": False, "env_failed": False, "drop_flag": False,
            "error": None, "policy_version": version, "started_ms": 0, "finished_ms": 0,
            "worker": ""}


def traj_group(key, trajectories):
    return {"group_key": key, "kind": "agentic", "accepted": True, "reason": "accepted",
            "trajectories": trajectories}


def two_turn():
    # prompt [1, 2, 3]; model says [10, 11]; environment answers [20, 21, 22]; model says [12]
    return trajectory(1, [turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
                          turn([20, 21, 22], [12], [-0.3])],
                      mask=[1, 1, 0, 0, 0, 1], reward=1.0, version=5)


def one_turn():
    return trajectory(0, [turn([1, 2, 3], [30], [-0.5])], mask=[1], reward=0.0, version=4)


A_PAIR = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of rewards [1, 0] (and minus for 0)


def test_trajectory_group_flattens_turns_and_trains_model_tokens_only():
    g = traj_group("train/0/0", [two_turn(), one_turn()])  # out of traj_index order
    batch = build_batch([g], step=2, pad_token_id=PAD)

    assert torch.equal(batch.prompt_ids, torch.tensor([[1, 2, 3], [1, 2, 3]]))
    assert torch.equal(batch.prompt_mask, torch.tensor([[1, 1, 1], [1, 1, 1]]))
    assert torch.equal(batch.response_ids, torch.tensor(
        [[30, 0, 0, 0, 0, 0], [10, 11, 20, 21, 22, 12]], dtype=torch.int64))
    assert batch.response_mask.dtype == torch.float32
    assert torch.equal(batch.response_mask, torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.float32))
    assert torch.equal(batch.infer_logprobs, torch.tensor(
        [[-0.5, 0, 0, 0, 0, 0], [-0.1, -0.2, 0, 0, 0, -0.3]], dtype=torch.float32))
    assert torch.equal(batch.response_level_rewards, torch.tensor([0.0, 1.0]))
    a = A_PAIR
    torch.testing.assert_close(batch.advantages, torch.tensor(
        [[-a, 0, 0, 0, 0, 0], [a, a, 0, 0, 0, a]], dtype=torch.float32))
    assert torch.all(batch.advantages[batch.response_mask == 0] == 0)
    assert batch.group_keys == ["train/0/0"]
    assert batch.prompt_ids_str == ["train/0/0", "train/0/0"]
    assert batch.sample_index == [0, 1]
    assert batch.policy_versions == [4, 5]
    assert batch.group_index.tolist() == [0, 0]
    assert (batch.step, batch.batch_size, batch.responses_per_group) == (2, 2, [2])


def test_trajectory_response_mask_is_taken_from_the_trajectory():
    # the producer may leave a model token untrained (mask 0): its logprob still sits in place
    t = trajectory(0, [turn([1], [10, 11], [-0.1, -0.2]), turn([20], [12], [-0.3])],
                   mask=[1, 0, 0, 1], reward=2.0)
    other = trajectory(1, [turn([1], [13], [-0.4])], mask=[1], reward=0.0)
    batch = build_batch([traj_group("k", [t, other])], step=0, pad_token_id=PAD)
    assert batch.response_mask[0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert torch.equal(batch.infer_logprobs[0], torch.tensor([-0.1, -0.2, 0.0, -0.3]))
    torch.testing.assert_close(batch.advantages[0], torch.tensor([A_PAIR, 0, 0, A_PAIR]))


def test_rlvr_and_agentic_groups_mix_in_one_batch(two_groups):
    rlvr = two_groups[0]  # responses [31, 32, 33] (reward 1) and [21] (reward 0), prompt of 3
    agentic = traj_group("train/0/0", [two_turn(), one_turn()])
    batch = build_batch([agentic, rlvr, two_groups[1]], step=1, pad_token_id=PAD)

    assert batch.group_keys == ["train/0/0", "a", "b"]
    assert batch.responses_per_group == [2, 2, 2]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.prompt_ids_str == ["train/0/0", "train/0/0", "a", "a", "b", "b"]
    assert batch.sample_index == [0, 1, 0, 1, 0, 1]
    assert batch.policy_versions == [4, 5, 2, 3, 3, 3]
    assert torch.equal(batch.prompt_ids, torch.tensor(
        [[1, 2, 3], [1, 2, 3], [11, 12, 13], [11, 12, 13], [0, 0, 14], [0, 0, 14]]))
    assert torch.equal(batch.response_ids, torch.tensor([
        [30, 0, 0, 0, 0, 0], [10, 11, 20, 21, 22, 12], [31, 32, 33, 0, 0, 0],
        [21, 0, 0, 0, 0, 0], [41, 42, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]))
    assert torch.equal(batch.response_mask, torch.tensor([
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32))
    assert torch.equal(batch.infer_logprobs, torch.tensor([
        [-0.5, 0, 0, 0, 0, 0], [-0.1, -0.2, 0, 0, 0, -0.3], [-0.1, -0.2, -0.3, 0, 0, 0],
        [-0.5, 0, 0, 0, 0, 0], [-1.0, -2.0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]))
    a = A_PAIR
    torch.testing.assert_close(batch.advantages, torch.tensor([
        [-a, 0, 0, 0, 0, 0], [a, a, 0, 0, 0, a], [a, a, a, 0, 0, 0],
        [-a, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]))
    assert torch.equal(batch.response_level_rewards, torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]))


def _bad_mask_length():
    t = two_turn()
    t["response_mask"] = [1, 1, 0, 0, 1]
    return t


def _bad_mask_value():
    t = two_turn()
    t["response_mask"] = [1, 1, 0, 0, 2, 1]
    return t


def _bad_logprobs():
    t = two_turn()
    t["turns"][1]["infer_logprobs"] = []
    return t


def _no_prompt():
    t = two_turn()
    t["turns"][0]["prompt_token_ids"] = []
    return t


def _no_turns():
    return trajectory(1, [], mask=[], reward=1.0)


@pytest.mark.parametrize("trajectories, message", [
    ([], "group 'k' has no trajectories"),
    ([one_turn(), one_turn()], "traj_index 0 appears twice"),
    ([_bad_logprobs()], "trajectory 1 turn 1: 1 response tokens but 0 infer_logprobs"),
    ([_bad_mask_length()], "response_mask has 5 entries but the flattened response has 6 tokens"),
    ([_bad_mask_value()], r"response_mask values must be 0 or 1, got \[2\]"),
    ([_no_prompt()], r"trajectory 1: turns\[0\] has no prompt tokens"),
    ([trajectory(0, [turn([1], [2], [-1.0])], [1], float("nan"))],
     "non-finite response_level_rewards nan"),
    ([trajectory(0, [turn([1], [2], [-1.0])], [1], float("-inf"))],
     "non-finite response_level_rewards -inf"),
])
def test_check_group_rejects_invalid_trajectory_groups(trajectories, message):
    g = traj_group("k", trajectories)
    with pytest.raises(ValueError, match=message):
        check_group(g)
    with pytest.raises(ValueError, match=message):
        build_batch([traj_group("ok", [one_turn()]), g], step=0, pad_token_id=PAD)


def test_a_trajectory_without_turns_is_an_all_padding_placeholder():
    """The environment failed before the model spoke: the row trains nothing (mask 0, advantage
    0) but its reward still counts in the group's GRPO statistics, like the reference's
    placeholder."""
    batch = build_batch([traj_group("k", [one_turn(), _no_turns()])], step=0, pad_token_id=PAD)
    assert batch.responses_per_group == [2]
    assert batch.response_mask[1].sum().item() == 0 and batch.prompt_mask[1].sum().item() == 0
    assert torch.all(batch.advantages[1] == 0)
    assert batch.response_level_rewards.tolist() == [0.0, 1.0]
    assert batch.advantages[0][batch.response_mask[0] > 0].lt(0).all()  # 0 below the group's mean of 0.5


def test_check_group_accepts_a_valid_trajectory_group():
    check_group(traj_group("k", [two_turn(), one_turn()]))  # no exception
