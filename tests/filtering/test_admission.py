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
