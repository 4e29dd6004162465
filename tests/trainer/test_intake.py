"""What the trainer lets into its buffer: trainable groups, redelivered keys, stale rejections."""

from __future__ import annotations

from rollstream.filtering.staleness import stale_decision
from rollstream.schemas import encode
from rollstream.streams.events import group_record
from rollstream.trainer.intake import RecentKeys, stale_rejection, trainable_group


def rlvr_group(key: str = "p1", *, accepted: bool = True, logprobs: list[float] | None = None) -> dict:
    responses = [{
        "response": {
            "prompt_id": key, "domain": "math", "mode": "train", "prompt": "1+1=", "ground_truth": "2",
            "round": 0, "sample_index": i, "prompt_token_ids": [1, 2], "response_token_ids": [7, 8],
            "infer_logprobs": logprobs if logprobs is not None else [-0.5, -0.25], "response_text": "2",
            "finish_reason": "stop", "error": None, "policy_version": 0, "generation_ms": 1.0, "created_ms": 1,
        },
        "response_level_reward": float(i), "reward_ms": 1.0, "created_ms": 1,
    } for i in range(2)]
    return group_record(prompt=responses[0]["response"], decided_accepted=accepted,
                        reason="accepted" if accepted else "zero_std", values={"std": 0.5}, responses=responses,
                        filter_config="{}", filter_config_hash="h", policy_version=0, rounds=1,
                        responses_generated=2, prompt_token_ids=[1, 2])


def test_an_accepted_valid_group_is_trainable():
    group, problem = trainable_group(encode(rlvr_group("p7"), "Group"))
    assert problem is None
    assert group["group_key"] == "p7" and len(group["responses"]) == 2


def test_bytes_that_are_not_an_event_are_undecodable():
    group, (reason, _) = trainable_group(b"not avro")
    assert (group, reason) == (None, "undecodable")
    assert trainable_group(None)[1][0] == "undecodable"


def test_another_schema_is_an_invalid_event():
    value = encode({"step": 0, "status": "complete", "target_groups": 1, "accepted_groups": 1}, "Batch")
    group, (reason, error) = trainable_group(value)
    assert (group, reason) == (None, "invalid_event")
    assert error == "expected Group or TrajectoryGroup, got Batch"


def test_a_rejected_group_on_the_accepted_topic_is_an_invalid_event():
    _, (reason, error) = trainable_group(encode(rlvr_group("p3", accepted=False), "Group"))
    assert reason == "invalid_event"
    assert error == "group 'p3' on the accepted topic is not accepted (reason 'zero_std')"


def test_a_group_failing_check_group_is_an_invalid_event():
    _, (reason, error) = trainable_group(encode(rlvr_group("p4", logprobs=[-0.5]), "Group"))
    assert reason == "invalid_event"
    assert "p4" in error and "infer_logprobs" in error


def test_recent_keys_forget_the_oldest_beyond_the_window():
    keys = RecentKeys(window=2)
    for key in ("a", "b", "c"):
        keys.add(key)
    assert ("a" in keys, "b" in keys, "c" in keys, len(keys)) == (False, True, True, 2)
    keys.add("b")  # seen again: now the newest
    keys.add("d")
    assert ("b" in keys, "c" in keys, "d" in keys) == (True, False, True)


def test_stale_rejection_keeps_the_group_and_adds_the_decision_values():
    group = rlvr_group("p9")
    decision = stale_decision(0, 3, 1)
    rejected = stale_rejection(group, decision)
    assert (rejected["accepted"], rejected["reason"]) == (False, "stale")
    assert rejected["decision_values"] == {"std": 0.5, "policy_version": 0.0, "current_version": 3.0,
                                           "max_staleness": 1.0, "lag": 3.0}
    assert rejected["responses"] == group["responses"]
    assert group["accepted"] is True  # the input is not changed
    encode(rejected, "Group")  # still a valid Group record
