"""What the trainer lets into its buffer and into a batch: trainable groups, redelivered keys,
stale rejections, payload references and their decoded records."""

from __future__ import annotations

import pytest

from rollstream.filtering.staleness import stale_decision
from rollstream.schemas import encode
from rollstream.schemas.records import payload_ref, payload_refs
from rollstream.trainer.batch import check_payloads
from rollstream.trainer.intake import RecentKeys, resolve_payloads, stale_rejection, trainable_group

from . import records

TOPIC = "t.responses"


def responses_of(key: str, logprobs: list[float] | None = None) -> list[dict]:
    return [records.response_payload(key, i, [1, 2], [7, 8], logprobs if logprobs is not None else [-0.5, -0.25])
            for i in range(2)]


def rlvr_group(key: str = "p1", *, accepted: bool = True, logprobs: list[float] | None = None,
               refs: bool = True) -> dict:
    """An RLVR Group of two responses; ``refs``: members name their payloads by PayloadRef
    (offsets 10 and 11 of TOPIC), else the payloads are inline."""
    members = [records.rewarded(resp, float(i), payload_ref(TOPIC, 0, 10 + i, 64) if refs else None)
               for i, resp in enumerate(responses_of(key, logprobs))]
    group = records.rlvr_group(key, members, accepted=accepted, reason=None if accepted else "zero_std")
    group["decision_values"] = {"std": 0.5}
    return group


def fetched(key: str, logprobs: list[float] | None = None) -> dict:
    """What PayloadFetcher.fetch would hand back for ``rlvr_group(key)``'s references."""
    return {(TOPIC, 0, 10 + i): encode(resp, "Response") for i, resp in enumerate(responses_of(key, logprobs))}


def test_an_accepted_valid_group_is_trainable():
    group, problem = trainable_group(encode(rlvr_group("p7"), "Group"))
    assert problem is None
    assert group["group_key"] == "p7" and len(group["responses"]) == 2
    assert [ref["offset"] for ref in payload_refs(group)] == [10, 11]


def test_resolve_payloads_puts_the_decoded_records_in_place_of_the_references():
    group = trainable_group(encode(rlvr_group("p7"), "Group"))[0]
    resolved = resolve_payloads(group, fetched("p7"))
    check_payloads(resolved)
    assert [rr["payload"]["response_token_ids"].tolist() for rr in resolved["responses"]] == [[7, 8], [7, 8]]
    assert [rr["payload"]["sample_index"] for rr in resolved["responses"]] == [0, 1]
    assert payload_refs(resolved) == []
    assert [ref["offset"] for ref in payload_refs(group)] == [10, 11]  # the consumed event is unchanged


def test_inline_payloads_need_no_fetch():
    group = rlvr_group("p8", refs=False)
    assert payload_refs(group) == []
    assert resolve_payloads(group, {}) == group


def test_a_payload_of_another_member_or_schema_or_missing_is_refused():
    group = rlvr_group("p9")
    swapped = fetched("p9")
    swapped[(TOPIC, 0, 10)], swapped[(TOPIC, 0, 11)] = swapped[(TOPIC, 0, 11)], swapped[(TOPIC, 0, 10)]
    with pytest.raises(ValueError, match=r"group 'p9' member \('p9', 0\): payload t.responses\[0\]@10 is the "
                                         r"Response of \('p9', 1\), not of this member"):
        resolve_payloads(group, swapped)
    other = {**fetched("p9"), (TOPIC, 0, 11): encode(records.response_payload("zz", 1, [1], [2], [-1.0]), "Response")}
    with pytest.raises(ValueError, match=r"is the Response of \('zz', 1\)"):
        resolve_payloads(group, other)
    batch_event = encode({"step": 0, "status": "complete", "target_groups": 1, "accepted_groups": 1}, "Batch")
    with pytest.raises(ValueError, match=r"payload t.responses\[0\]@10 is a Batch, expected a Response"):
        resolve_payloads(group, {**fetched("p9"), (TOPIC, 0, 10): batch_event})
    with pytest.raises(ValueError, match="does not decode"):
        resolve_payloads(group, {**fetched("p9"), (TOPIC, 0, 10): b"junk"})
    with pytest.raises(ValueError, match=r"payload t.responses\[0\]@11 was not fetched"):
        resolve_payloads(group, {(TOPIC, 0, 10): fetched("p9")[(TOPIC, 0, 10)]})


def test_a_trajectory_payload_must_match_its_summary():
    trajs = [records.trajectory_payload(i, [records.turn([1], [2], [-1.0])], [1], float(i), group_id=3, episode_id=4)
             for i in range(2)]
    ref = [payload_ref("t.trajectories", 1, 5 + i) for i in range(2)]
    group = records.traj_group("train/3/4", [records.member(t, r) for t, r in zip(trajs, ref)], group_id=3, episode_id=4)
    values = {("t.trajectories", 1, 5 + i): encode(t, "Trajectory") for i, t in enumerate(trajs)}
    resolved = resolve_payloads(group, values)
    check_payloads(resolved)
    assert [m["payload"]["traj_index"] for m in resolved["trajectories"]] == [0, 1]
    values[("t.trajectories", 1, 5)] = encode(records.response_payload("p", 0, [1], [2], [-1.0]), "Response")
    with pytest.raises(ValueError, match=r"member \('train', 3, 4, 0\): payload t.trajectories\[1\]@5 is a "
                                         "Response, expected a Trajectory"):
        resolve_payloads(group, values)


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
    group = rlvr_group("p4")
    group["responses"][1]["response"]["sample_index"] = 0
    _, (reason, error) = trainable_group(encode(group, "Group"))
    assert reason == "invalid_event"
    assert error == "group 'p4': sample_index 0 appears twice"


def test_a_payload_fault_passes_intake_and_is_found_once_fetched():
    group, problem = trainable_group(encode(rlvr_group("p4", logprobs=[-0.5]), "Group"))
    assert problem is None  # the decision event cannot show it
    with pytest.raises(ValueError, match="group 'p4' sample 0: 2 response tokens but 1 infer_logprobs"):
        check_payloads(resolve_payloads(group, fetched("p4", logprobs=[-0.5])))


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
