"""Admission credits and the bounded resampling budget (pure)."""

from __future__ import annotations

import random

import pytest

from rollstream.filtering import admission as core


def limits(**kw):
    base = dict(rollout_batch_size=4, max_running_prompts=8, max_prompts_per_batch=24)
    return core.AdmissionLimits(**{**base, **kw})


def fill(state, lim, start=0):
    """Admit prompts while credits allow; returns the admitted ids."""
    ids = []
    while core.can_admit(state, lim):
        pid = f"p{start + len(ids)}"
        core.admit(state, pid)
        ids.append(pid)
    return ids


def test_admits_only_the_batch_deficit_and_one_replacement_per_rejection():
    lim = limits(rollout_batch_size=64, max_running_prompts=64, max_prompts_per_batch=1000)
    state = core.AdmissionState()
    first = fill(state, lim)
    assert len(first) == 64
    for pid in first[:63]:
        state, _ = core.on_outcome(state, lim, pid, True, "accepted")
    state, _ = core.on_outcome(state, lim, first[63], False, "zero_std")
    refill = fill(state, lim, 64)
    assert refill == ["p64"]  # one rejection -> one prompt, not a wave of 64


def test_budget_ends_a_hopeless_step_with_batch_underfilled():
    # G=4, batch 4, budget 24 prompts, only two prompts ever pass
    lim = limits(max_prompts_per_batch=24)
    state, effects, n, admitted = core.AdmissionState(), [], 0, []
    passing = {"p5", "p17"}
    while True:
        ids = fill(state, lim, n)
        n += len(ids)
        admitted += ids
        if not ids and not state.in_flight:
            break
        for pid in ids:
            state, eff = core.on_outcome(state, lim, pid, pid in passing, "accepted" if pid in passing else "zero_std")
            effects += eff
        if effects:
            break
    assert len(admitted) == 24  # never a 25th
    assert effects == [core.BatchUnderfilled(step=0, accepted=2, target=4, prompts_consumed=24,
                                             rejected_by_reason={"zero_std": 22})]
    assert state.step == 1 and state.admitted_in_step == 0


def test_step_completes_and_surplus_accepted_groups_carry_over():
    lim = limits(rollout_batch_size=2, max_additional_running_prompts=2)
    state = core.AdmissionState()
    ids = fill(state, lim)
    assert len(ids) == 4
    state, eff = core.on_outcome(state, lim, ids[0], True, "accepted")
    state, eff = core.on_outcome(state, lim, ids[1], True, "accepted")
    assert eff == [core.StepComplete(step=0, accepted=2, prompts_consumed=4, rejected_by_reason={})]
    state, eff = core.on_outcome(state, lim, ids[2], True, "accepted")  # late, from step 0
    assert state.step == 1 and state.accepted_in_step == 1  # kept for the next batch, never dropped


def test_oversample_by_yield_keeps_the_deficit_over_the_recent_yield_in_flight():
    """Three of four recent prompts rejected: a deficit of 2 puts 8 in flight at once."""
    on = limits(rollout_batch_size=2, max_running_prompts=16, oversample_by_yield=True)
    state = core.AdmissionState(recent_outcomes=[1, 0, 0, 0] * 8)
    assert state.recent_yield() == 0.25
    assert core.in_flight_target(state, on) == 8 and len(fill(state, on)) == 8
    assert len(fill(core.AdmissionState(recent_outcomes=[1, 0, 0, 0] * 8), limits(rollout_batch_size=2))) == 2
    capped = limits(rollout_batch_size=2, max_running_prompts=6, oversample_by_yield=True)
    assert len(fill(core.AdmissionState(recent_outcomes=[1, 0, 0, 0]), capped)) == 6
    assert len(fill(core.AdmissionState(recent_outcomes=[0] * 5), capped)) == 6  # nothing passes: every slot
    assert len(fill(core.AdmissionState(), on)) == 2  # no outcome yet: yield 1, the deficit alone
    assert len(fill(core.AdmissionState(recent_outcomes=[1] * 32), on)) == 2  # no_filter: today's admission
    state = core.AdmissionState(recent_outcomes=[1, 0] * 16, accepted_in_step=1)
    assert core.in_flight_target(state, on) == 2  # the deficit left (1) over the yield (0.5)


def test_the_yield_is_taken_over_the_last_outcomes_and_survives_a_restart():
    lim = limits(rollout_batch_size=1, max_running_prompts=64, max_prompts_per_batch=1000, oversample_by_yield=True)
    state = core.AdmissionState()
    for i in range(40):  # 8 accepted, then 32 rejected (each a step's deficit, admitted one by one)
        core.admit(state, f"p{i}")
        state, _ = core.on_outcome(state, lim, f"p{i}", i < 8, "accepted" if i < 8 else "zero_std")
    assert state.recent_outcomes == [0] * core.YIELD_WINDOW and state.recent_yield() == 0.0
    assert core.AdmissionState.from_dict(state.to_dict()).recent_outcomes == state.recent_outcomes
    core.admit(state, "val", mode="val")
    state, _ = core.on_outcome(state, lim, "val", True, "accepted")
    assert state.recent_outcomes == [0] * core.YIELD_WINDOW  # validation is no train outcome


def test_a_late_group_counts_for_the_next_step_when_that_step_may_still_train_it():
    """Step 0 filled while c (of step 0) was in flight; the trainer puts c in step 1's batch
    (groups in the order they come) unless c's version is too old for step 1."""
    lim = limits(rollout_batch_size=2, max_additional_running_prompts=1, max_staleness=1)
    for version, counted in ((0, 1), (None, 0)):
        state = core.AdmissionState()
        fill(state, lim)
        for pid in ("p0", "p1", "p2"):
            state, _ = core.on_outcome(state, lim, pid, True, "accepted", policy_version=version)
        assert (state.step, state.accepted_in_step) == (1, counted)
    state = core.AdmissionState(step=3)
    fill(state, lim)
    state.step, state.accepted_in_step = 4, 0  # as if step 3 had filled: p2 is late
    state, _ = core.on_outcome(state, lim, "p2", True, "accepted", policy_version=2)
    assert state.accepted_in_step == 0  # version 2 may train step 3, not step 4 (bound 1)


def test_prompt_rejected_before_generation_spends_budget_not_a_slot():
    lim = limits(rollout_batch_size=1, max_prompts_per_batch=2, max_running_prompts=1)
    state = core.AdmissionState()
    state = core.reject_before_generation(state, "prompt_too_long")
    state = core.reject_before_generation(state, "prompt_too_long")
    state, effects = core.check_step(state, lim)
    assert effects == [core.BatchUnderfilled(0, 0, 1, 2, {"prompt_too_long": 2})]


def test_a_validation_round_is_admitted_whole_takes_no_train_slot_and_never_counts_towards_a_batch():
    lim = limits(rollout_batch_size=2, max_running_prompts=2)
    state = core.AdmissionState()
    core.admit(state, "v0", "val")
    assert core.can_admit(state, lim) and core.can_admit(state, lim, "val")
    core.admit(state, "p0")
    assert core.can_admit(state, lim)  # the round in flight holds no train slot
    core.admit(state, "p1")
    assert not core.can_admit(state, lim)  # the train slots are full
    for k in (1, 2, 3):  # the rest of the round does not wait for them: one version generates it
        assert core.can_admit(state, lim, "val")
        core.admit(state, f"v0-{k}", "val")
    state, eff = core.on_outcome(state, lim, "p0", False, "mean_too_high")
    assert core.can_admit(state, lim) and len(state.in_flight) == 5  # a train slot is free, the round still runs
    for vid in ("v0", "v0-1", "v0-2"):
        state, eff = core.on_outcome(state, lim, vid, True, "accepted")
        assert eff == [] and state.accepted_in_step == 0
    assert state.val_admitted == 4 and state.train_in_flight() == 1


def test_unknown_or_repeated_outcome_is_ignored():
    lim = limits()
    state = core.AdmissionState()
    core.admit(state, "p0")
    state, _ = core.on_outcome(state, lim, "p0", False, "zero_std")
    state, eff = core.on_outcome(state, lim, "p0", False, "zero_std")
    assert eff == [core.UnknownOutcome("p0")] and state.rejected_in_step == {"zero_std": 1}


@pytest.mark.parametrize("seed", range(5))
def test_in_flight_never_exceeds_max_running_prompts(seed):
    rng = random.Random(seed)
    lim = limits(rollout_batch_size=8, max_running_prompts=3, max_prompts_per_batch=40, max_steps=3)
    state, n = core.AdmissionState(), 0
    for _ in range(500):
        n += len(fill(state, lim, n))
        assert state.train_in_flight() <= 3
        if not state.in_flight:
            break
        pid = rng.choice(sorted(state.in_flight))
        state, _ = core.on_outcome(state, lim, pid, rng.random() < 0.4, "zero_std")
    assert state.finished or state.step <= 3


def test_absurd_limits_are_rejected():
    with pytest.raises(ValueError, match="max_running_prompts"):
        limits(max_running_prompts=0)
    with pytest.raises(ValueError, match="max_prompts_per_batch"):
        limits(max_prompts_per_batch=2)
