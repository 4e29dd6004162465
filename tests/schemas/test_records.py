"""Record helpers shared by layers: the group kind test and the one Batch builder."""

from __future__ import annotations

from rollstream.schemas import decode, encode
from rollstream.schemas.records import batch_event, group_rows, group_schema, is_set_aside, is_trajectory_group

RLVR = {"group_key": "p1", "responses": [{"r": 0}, {"r": 1}]}
AGENTIC = {"group_key": "g1/0", "trajectories": [{"t": 0}, {"t": 1}, {"t": 2}]}


def test_kind_schema_and_rows_of_each_group_kind():
    assert (is_trajectory_group(RLVR), group_schema(RLVR), len(group_rows(RLVR))) == (False, "Group", 2)
    assert (is_trajectory_group(AGENTIC), group_schema(AGENTIC), len(group_rows(AGENTIC))) == (
        True, "TrajectoryGroup", 3)
    assert group_rows(AGENTIC) is AGENTIC["trajectories"]


def test_underfilled_batch_event_round_trips():
    event = batch_event(step=2, status="underfilled", target=4, accepted=1, prompts_consumed=24,
                        rejected_by_reason={"zero_std": 22}, created_ms=1234)
    assert decode(encode(event, "Batch")) == ("Batch", {
        "step": 2, "status": "underfilled", "target_groups": 4, "accepted_groups": 1, "prompts_consumed": 24,
        "rejected_by_reason": {"zero_std": 22}, "group_keys": [], "offsets": {}, "fill_seconds": 0.0,
        "created_ms": 1234,
    })


def test_created_ms_defaults_to_now(monkeypatch):
    monkeypatch.setattr("rollstream.schemas.records.now_ms", lambda: 777)
    assert batch_event(step=0, status="underfilled", target=1, accepted=0)["created_ms"] == 777
    assert batch_event(step=0, status="complete", target=1, accepted=1, created_ms=0)["created_ms"] == 0


def test_trainer_batch_event_encodes_like_a_record_without_admission_fields():
    """The trainer's event leaves prompts_consumed and rejected_by_reason at their schema defaults."""
    keys, offsets = ["a", "b"], {"0": 7, "1": 3}
    event = batch_event(step=3, status="partial", target=4, accepted=2, group_keys=keys, offsets=offsets,
                        fill_seconds=1.5, created_ms=9)
    without = {"step": 3, "status": "partial", "target_groups": 4, "accepted_groups": 2, "group_keys": keys,
               "offsets": offsets, "fill_seconds": 1.5, "created_ms": 9}
    assert encode(event, "Batch") == encode(without, "Batch")
    keys.append("c")  # the event holds copies
    assert event["group_keys"] == ["a", "b"]


def test_only_a_trajectory_unit_is_a_set_aside():
    assert [is_set_aside(g) for g in (RLVR, {**AGENTIC, "unit": "episode"}, {**AGENTIC, "unit": "trajectory"})] == [
        False, False, True]


def test_summaries_carry_lengths_and_the_reference_never_the_arrays():
    import numpy as np

    from rollstream.schemas import decode, encode
    from rollstream.schemas.records import is_payload_ref, payload_ref, response_summary, trajectory_summary

    response = {"prompt_id": "p", "domain": "d", "prompt": "q", "round": 1, "sample_index": 3,
                "prompt_token_ids": np.arange(5, dtype=np.int32), "response_token_ids": [1, 2, 3],
                "infer_logprobs": [0.0] * 3, "finish_reason": "length", "response_text": "abc"}
    summary = response_summary(response)
    assert (summary["prompt_length"], summary["response_length"], summary["finish_reason"], summary["mode"]) == (
        5, 3, "length", "train")
    assert not {"prompt_token_ids", "response_token_ids", "infer_logprobs", "response_text"} & set(summary)
    assert decode(encode(summary, "ResponseSummary"))[1] == summary

    ref = payload_ref("rollstream.trajectories", 1, 99, 1234)
    traj = {"mode": "train", "group_id": 1, "episode_id": 0, "traj_index": 2, "env_type": "e", "seed": 7,
            "turns": [{"prompt_token_ids": [1, 2], "response_token_ids": [3], "infer_logprobs": [0.0]},
                      {"prompt_token_ids": [4, 5], "response_token_ids": [6, 7], "infer_logprobs": [0.0, 0.0]}],
            "response_mask": np.array([1, 0, 0, 1, 1], dtype=np.uint8), "response_level_rewards": 1.0,
            "stop_reason": "done", "extras": {}}
    member = trajectory_summary(traj, ref)
    assert (member["num_turns"], member["prompt_length"], member["response_length"], member["model_tokens"]) == (
        2, 2, 5, 3)
    assert is_payload_ref(member["payload"]) and not {"turns", "response_mask", "extras"} & set(member)
    assert decode(encode(member, "TrajectorySummary"))[1]["payload"] == ref
