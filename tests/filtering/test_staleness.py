"""The staleness bound (max_staleness, in policy versions): the pure checks, the admission's gate
and the aggregator's ``stale`` rejection."""

from __future__ import annotations

from rollstream.filtering.admission import AdmissionLimits, AdmissionState, can_admit
from rollstream.filtering.prompt_state import Decided, DomainFilters, step
from rollstream.filtering.staleness import may_start_step, stale_decision


def test_stale_decision_rejects_only_beyond_the_bound():
    assert stale_decision(3, 4, 1) is None  # lag 1 <= 1
    d = stale_decision(2, 4, 1)
    assert (d.keep, d.reason) == (False, "stale")
    assert dict(d.values) == {"policy_version": 2.0, "current_version": 4.0, "max_staleness": 1.0, "lag": 2.0}
    assert stale_decision(0, 100, None) is None  # unbounded
    assert stale_decision(0, None, 0) is None  # nothing published yet: no lag known


def test_may_start_step_waits_for_the_version_the_bound_needs():
    assert may_start_step(0, None, 0)  # step 0 needs version 0, assumed before any is published
    assert not may_start_step(1, None, 0) and not may_start_step(1, 0, 0)
    assert may_start_step(1, 1, 0)
    assert may_start_step(3, 1, 2) and not may_start_step(4, 1, 2)
    assert may_start_step(50, None, None)


def test_admission_holds_the_next_step_until_its_policy_version_exists():
    limits = AdmissionLimits(rollout_batch_size=2, max_running_prompts=8, max_prompts_per_batch=8, max_staleness=0)
    state = AdmissionState(step=1)
    assert not can_admit(state, limits, "train", policy_version=0)
    assert can_admit(state, limits, "val", policy_version=0)  # validation never waits on training
    assert can_admit(state, limits, "train", policy_version=1)


def rewarded(index: int, version: int, reward: float, mode: str = "train") -> dict:
    return {"response": {"prompt_id": "p", "domain": "math", "mode": mode, "sample_index": index,
                         "finish_reason": "stop", "response_length": 2, "policy_version": version},
            "response_level_reward": reward, "scores": {}}


def decide(versions: list[int], current: int | None, max_staleness: int | None, mode: str = "train") -> Decided:
    filters = DomainFilters(num_return_sequences=len(versions), query_filter_config={"type": "std_filter"},
                            max_staleness=max_staleness, val_num_return_sequences=len(versions))
    state, effects = None, []
    for i, v in enumerate(versions):
        state, effects = step(state, rewarded(i, v, float(i % 2), mode), filters, current)
    (decided,) = [e for e in effects if isinstance(e, Decided)]
    return decided


def test_a_group_lagging_beyond_max_staleness_is_rejected_stale_with_its_values():
    decided = decide([3, 1], current=3, max_staleness=1)  # oldest response: v1, lag 2
    assert (decided.accepted, decided.reason, decided.policy_version) == (False, "stale", 1)
    assert decided.values["lag"] == 2.0 and decided.values["current_version"] == 3.0


def test_within_the_bound_or_unbounded_the_query_filter_decides():
    assert decide([2, 3], current=3, max_staleness=1).reason == "accepted"
    assert decide([0, 0], current=9, max_staleness=None).reason == "accepted"
    assert decide([0, 0], current=None, max_staleness=0).reason == "accepted"


def test_validation_groups_are_never_rejected_stale():
    assert decide([0, 0], current=9, max_staleness=0, mode="val").accepted


def test_with_a_staleness_bound_groups_beyond_the_target_do_not_count_for_the_next_step():
    from rollstream.filtering.admission import admit, on_outcome

    for bound, carried in ((None, 1), (0, 0)):
        limits = AdmissionLimits(rollout_batch_size=2, max_running_prompts=4, max_prompts_per_batch=8,
                                 max_additional_running_prompts=1, max_staleness=bound)
        state = admit(admit(admit(AdmissionState(), "a"), "b"), "c")
        for pid in "abc":  # c: one beyond the target of step 0
            state, _ = on_outcome(state, limits, pid, True, "accepted")
        assert (state.step, state.accepted_in_step) == (1, carried)
