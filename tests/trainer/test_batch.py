"""Pure tests of rollstream.trainer.batch: padding layout, GRPO advantages, validation, extras.

Members carry their payload inline (as the BatchBuilder leaves them after the fetch); the
summary/payload split of the checks and the packed (numpy) arrays of decoded events are tested
too."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollstream.schemas import decode, encode
from rollstream.schemas.packed import packed_array
from rollstream.schemas.records import payload_ref
from rollstream.trainer.batch import RolloutBatch, build_batch, check_group, check_payloads, grpo_advantages
from rollstream.trainer.grpo import _rows_of

from . import records

PAD = 0


def rewarded(prompt_id, sample_index, prompt, tokens, logprobs, reward, version=0, extras=None):
    """A RewardedResponse record (summary + reward) whose payload, the Response, is inline."""
    return records.rewarded(records.response_payload(prompt_id, sample_index, list(prompt), list(tokens),
                                                     list(logprobs), version=version, extras=extras), reward)


def group(key, responses):
    return records.rlvr_group(key, responses)


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


def test_build_batch_uses_group_prompt_tokens_when_an_old_format_response_has_none():
    """A Group of the format before payload references (v1: responses inline, the prompt tokens
    on the group) decodes with its payloads inline; a response stored without its own prompt
    tokens gets the group's, and the batch needs no fetch."""
    v1 = {
        "group_key": "g", "kind": "rlvr", "prompt_id": "g", "domain": "math", "mode": "train", "accepted": True,
        "reason": "accepted", "decision_values": {}, "filter_config": "{}", "filter_config_hash": "",
        "policy_version": 0, "rounds": 1, "responses_generated": 1, "prompt": "q", "ground_truth": "",
        "prompt_token_ids": [7, 8], "created_ms": 0,
        "responses": [{"response": {
            "prompt_id": "g", "domain": "math", "mode": "train", "prompt": "q", "ground_truth": "", "round": 0,
            "sample_index": 0, "prompt_token_ids": [], "response_token_ids": [5], "infer_logprobs": [-1.0],
            "response_text": "", "finish_reason": "stop", "error": None, "policy_version": 0,
            "generation_ms": 0.0, "created_ms": 0},
            "response_level_reward": 1.0, "scores": {}, "meta": {}, "reward_error": None, "reward_ms": 0.0}],
    }
    name, g = decode(records.encode_history(v1, "history/group.v1.avsc"))
    assert name == "Group" and "prompt_token_ids" not in g
    batch = build_batch([g], step=0, pad_token_id=99)
    assert batch.prompt_ids.tolist() == [[7, 8]]
    assert batch.response_ids.tolist() == [[5]] and batch.infer_logprobs.tolist() == [[-1.0]]
    assert batch.advantages.tolist() == [[0.0]]  # group of one


def test_decoded_packed_arrays_build_the_same_batch_as_lists(two_groups):
    """Events read from Kafka carry read-only numpy views (packed bytes): same tensors, no copy
    needed by the caller."""
    decoded = [decode(encode(g, "Group"))[1] for g in two_groups]
    assert isinstance(decoded[0]["responses"][0]["payload"]["response_token_ids"], np.ndarray)
    got, want = build_batch(decoded, step=1, pad_token_id=PAD), build_batch(two_groups, step=1, pad_token_id=PAD)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "infer_logprobs", "advantages",
                 "response_lengths", "response_level_rewards", "group_index"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype
    assert got.response_ids.dtype == torch.int64 and got.infer_logprobs.dtype == torch.float32


def test_summary_checks_pass_without_payloads_and_payload_checks_need_them():
    ref = payload_ref("t.responses", 0, 5, 100)
    rr = rewarded("r", 0, [1], [5, 6], [-1.0], 1.0)  # token/logprob mismatch: only the payload shows it
    g = group("r", [rr])
    check_group({**g, "responses": [{**rr, "payload": ref}]})  # the summary is fine
    with pytest.raises(ValueError, match="payload not resolved"):
        check_payloads({**g, "responses": [{**rr, "payload": ref}]})
    with pytest.raises(ValueError, match="payload not resolved"):
        build_batch([{**g, "responses": [{**rr, "payload": ref}]}], step=0, pad_token_id=PAD)
    check_group(g)
    with pytest.raises(ValueError, match="group 'r' sample 0: 2 response tokens but 1 infer_logprobs"):
        check_payloads(g)


def test_a_response_without_prompt_tokens_fails_the_payload_check():
    g = group("np", [rewarded("np", 0, [], [5], [-1.0], 1.0)])
    check_group(g)
    with pytest.raises(ValueError, match="group 'np' sample 0: no prompt tokens"):
        check_payloads(g)


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
    """A Turn record with only the fields the batch reads filled in."""
    return records.turn(list(prompt), list(tokens), list(logprobs))


def trajectory(traj_index, turns, mask, reward, version=0, extras=None):
    """A Trajectory record (the payload); ``mask`` is its flattened response_mask."""
    return records.trajectory_payload(traj_index, turns, list(mask), reward, version=version, extras=extras)


def traj_group(key, trajectories):
    """A TrajectoryGroup whose members are the summaries of ``trajectories``, payloads inline."""
    return records.traj_group(key, [records.member(t) for t in trajectories])


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


@pytest.mark.parametrize("trajectories, message, seen_in", [
    ([], "group 'k' has no trajectories", "summary"),
    ([one_turn(), one_turn()], "traj_index 0 appears twice", "summary"),
    ([_bad_logprobs()], "trajectory 1 turn 1: 1 response tokens but 0 infer_logprobs", "payload"),
    ([_bad_mask_length()], "response_mask has 5 entries but the flattened response has 6 tokens", "payload"),
    ([_bad_mask_value()], r"response_mask values must be 0 or 1, got \[2\]", "payload"),
    ([_no_prompt()], r"trajectory 1: turns\[0\] has no prompt tokens", "payload"),
    ([trajectory(0, [turn([1], [2], [-1.0])], [1], float("nan"))],
     "non-finite response_level_rewards nan", "summary"),
    ([trajectory(0, [turn([1], [2], [-1.0])], [1], float("-inf"))],
     "non-finite response_level_rewards -inf", "summary"),
])
def test_check_group_rejects_invalid_trajectory_groups(trajectories, message, seen_in):
    """Summary faults are found at intake (check_group), token-array faults once the payload is
    there (check_payloads); build_batch runs both."""
    g = traj_group("k", trajectories)
    if seen_in == "summary":
        with pytest.raises(ValueError, match=message):
            check_group(g)
    else:
        check_group(g)  # the decision event alone looks trainable
        with pytest.raises(ValueError, match=message):
            check_payloads(g)
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
    check_payloads(traj_group("k", [two_turn(), one_turn()]))


def test_a_trajectory_payload_that_is_still_a_reference_is_not_built():
    g = records.traj_group("k", [records.member(one_turn(), payload_ref("t.trajectories", 0, 3))])
    check_group(g)
    with pytest.raises(ValueError, match="group 'k' trajectory 0: payload not resolved"):
        build_batch([g], step=0, pad_token_id=PAD)


def test_decoded_trajectory_payloads_build_the_same_batch_as_lists():
    g = traj_group("train/0/0", [two_turn(), one_turn()])
    decoded = decode(encode(g, "TrajectoryGroup"))[1]
    assert decoded["trajectories"][0]["payload"]["response_mask"].dtype == np.uint8
    got, want = build_batch([decoded], step=0, pad_token_id=PAD), build_batch([g], step=0, pad_token_id=PAD)
    for name in ("prompt_ids", "response_ids", "response_mask", "infer_logprobs", "advantages"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# -- per-token extras (e.g. routed_experts for MoE routing replay) ----------------------------------

LAYERS, TOP_K = 3, 2


def experts(n_tokens, seed, dtype="uint8", high=64):
    return np.random.default_rng(seed).integers(0, high, size=(n_tokens, LAYERS, TOP_K)).astype(dtype)


def test_routed_experts_of_every_row_become_one_zero_padded_tensor():
    arrays = [experts(3, 0), experts(1, 1), experts(2, 2)]
    a = group("a", [rewarded("a", 0, [1], [5, 6, 7], [-1.0] * 3, 1.0, extras={"routed_experts": packed_array(arrays[0])}),
                    rewarded("a", 1, [1], [8], [-1.0], 0.0, extras={"routed_experts": packed_array(arrays[1])})])
    b = group("b", [rewarded("b", 0, [1, 2], [9, 9], [-1.0] * 2, 1.0,
                             extras={"routed_experts": packed_array(arrays[2])})])
    for groups in ([a, b], [decode(encode(a, "Group"))[1], decode(encode(b, "Group"))[1]]):
        batch = build_batch(groups, step=0, pad_token_id=PAD)
        routed = batch.extras["routed_experts"]
        assert routed.shape == (3, 3, LAYERS, TOP_K) and routed.dtype == torch.uint8
        for row, array in enumerate(arrays):
            n = array.shape[0]
            assert np.array_equal(routed[row, :n].numpy(), array)
            assert routed[row, n:].eq(0).all()  # padding
        assert set(batch.extras) == {"routed_experts"}


def test_an_extra_some_row_lacks_is_left_out_and_without_extras_the_dict_is_empty(two_groups):
    assert build_batch(two_groups, step=0, pad_token_id=PAD).extras == {}
    partial = group("p", [rewarded("p", 0, [1], [5], [-1.0], 1.0, extras={"routed_experts": packed_array(experts(1, 3))}),
                          rewarded("p", 1, [1], [6], [-1.0], 0.0)])
    assert "routed_experts" not in build_batch([partial], step=0, pad_token_id=PAD).extras


def test_uint16_extras_widen_to_int32():
    array = experts(2, 4, dtype="uint16", high=1000)
    g = group("w", [rewarded("w", 0, [1], [5, 6], [-1.0] * 2, 1.0, extras={"routed_experts": packed_array(array)})])
    routed = build_batch([decode(encode(g, "Group"))[1]], step=0, pad_token_id=PAD).extras["routed_experts"]
    assert routed.dtype == torch.int32 and routed[0].tolist() == array.astype(np.int32).tolist()


def test_agentic_extras_run_along_the_flattened_response():
    flat = experts(6, 5)  # two_turn's flattened response has 6 tokens
    t = two_turn()
    t["extras"] = {"routed_experts": packed_array(flat)}
    o = one_turn()
    o["extras"] = {"routed_experts": packed_array(experts(1, 6))}
    batch = build_batch([traj_group("k", [t, o])], step=0, pad_token_id=PAD)
    routed = batch.extras["routed_experts"]
    assert routed.shape == (2, 6, LAYERS, TOP_K)
    assert np.array_equal(routed[1].numpy(), flat)  # row 1: traj_index 1
    assert routed[0, 1:].eq(0).all()


def test_an_extra_not_along_the_response_fails_the_payload_check():
    g = group("x", [rewarded("x", 0, [1], [5, 6], [-1.0] * 2, 1.0, extras={"routed_experts": packed_array(experts(3, 7))})])
    check_group(g)
    with pytest.raises(ValueError, match=r"extras\['routed_experts'\] has shape \(3, 3, 2\); its first dimension must "
                                         "be the 2 response tokens"):
        check_payloads(g)
    bad = {"dtype": "uint8", "shape": [2, 3], "data": b"\x00" * 5}
    g = group("y", [rewarded("y", 0, [1], [5, 6], [-1.0] * 2, 1.0, extras={"routed_experts": bad})])
    with pytest.raises(ValueError, match=r"extras\['routed_experts'\]: PackedArray of shape \(2, 3\) has 5 uint8 values"):
        check_payloads(g)


def test_extras_move_with_the_batch_and_are_sliced_into_micro_batches():
    arrays = [experts(2, 8), experts(1, 9)]
    g = group("m", [rewarded("m", i, [1], [5] * len(a), [-1.0] * len(a), float(i),
                             extras={"routed_experts": packed_array(a)}) for i, a in enumerate(arrays)])
    batch = build_batch([g], step=0, pad_token_id=PAD)
    moved = batch.to("cpu")
    assert torch.equal(moved.extras["routed_experts"], batch.extras["routed_experts"])
    micro = _rows_of(batch, slice(1, 2))
    assert micro.extras["routed_experts"].shape == (1, 2, LAYERS, TOP_K)
    assert np.array_equal(micro.extras["routed_experts"][0, :1].numpy(), arrays[1])
