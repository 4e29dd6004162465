"""Epochs and end of data in the admission core (pure): the order and ids of later epochs, the
one end-of-data verdict, and a restart that resumes mid-epoch."""

from __future__ import annotations

import json

import pytest

from rollstream.filtering import admission as core


def limits(**kw):
    base = dict(rollout_batch_size=2, max_running_prompts=2, max_prompts_per_batch=100, seed=42)
    return core.AdmissionLimits(**{**base, **kw})


class Crash(Exception):
    pass


def simulate(lim, prompts, accept=lambda pid: True, state=None, crash_after=None, admitted=None):
    """Feed ``prompts`` (ids; ``v*`` are validation) and then the PromptsEnd marker (offset
    ``len(prompts)``) through the core the way the admission shell does, deciding the oldest
    in-flight prompt whenever no credit is free; then decide the rest.

    A ``state`` that has read the marker resumes as a restarted shell does: the prompts before
    the marker are redeliveries (skipped) and the marker is handled again. ``crash_after``: raise
    Crash once that many prompts are admitted in all. Returns ``(state, admitted ids, effects)``;
    ``admitted`` (a list) collects the ids as they are admitted.
    """
    state = state or core.AdmissionState()
    admitted = [] if admitted is None else admitted
    effects: list = []

    def settle_oldest():
        pid = next(iter(state.in_flight))
        _, out = core.on_outcome(state, lim, pid, accept(pid), "accepted" if accept(pid) else "zero_std")
        effects.extend(out)

    def admit(pid, mode, replay):
        while not core.can_admit(state, lim, mode):
            assert state.in_flight, "no credit will ever come back"
            settle_oldest()
        if replay:
            core.take_replay(state, lim)
        core.admit(state, pid, mode)
        admitted.append(pid)
        if crash_after is not None and len(admitted) == crash_after:
            raise Crash(f"crashed after admitting {crash_after}")

    if state.end_offset is None:
        for pid in prompts:
            admit(pid, "val" if pid.startswith("v") else "train", False)
    train = [pid for pid in prompts if not pid.startswith("v")]
    _, out = core.on_data_end(state, lim, len(prompts), len(train))
    effects += out
    while (nxt := core.next_replay(state, lim)) is not None:
        epoch, index = nxt
        admit(core.epoch_prompt_id(train[index], epoch), "train", True)
    _, out = core.check_step(state, lim)
    effects += out
    while state.in_flight:
        settle_oldest()
    return state, admitted, effects


def test_epoch_order_is_seeded_per_epoch():
    assert core.epoch_order(6, 42, 1) == [0, 5, 1, 3, 2, 4]
    assert core.epoch_order(6, 42, 2) == [5, 2, 0, 3, 1, 4]
    assert core.epoch_order(6, 7, 1) == [2, 3, 5, 1, 4, 0]
    assert core.epoch_order(0, 42, 1) == []


def test_epoch_prompt_ids():
    assert core.epoch_prompt_id("p3", 0) == "p3"
    assert core.epoch_prompt_id("p3", 2) == "p3#e2"


def test_three_epochs_read_every_train_prompt_three_times_in_each_epochs_order():
    lim = limits(num_epochs=3, rollout_batch_size=100, max_running_prompts=100)
    prompts = ["p0", "p1", "v0", "p2", "p3", "p4", "p5"]
    _, admitted, _ = simulate(lim, prompts)
    train = ["p0", "p1", "p2", "p3", "p4", "p5"]
    assert admitted == (prompts + [f"{train[i]}#e1" for i in [0, 5, 1, 3, 2, 4]]
                        + [f"{train[i]}#e2" for i in [5, 2, 0, 3, 1, 4]])  # v0 is not repeated


def test_one_epoch_ends_with_one_verdict_for_the_unfilled_step():
    lim = limits(rollout_batch_size=4, max_running_prompts=4)
    state, admitted, effects = simulate(lim, ["p0", "p1", "p2"], accept=lambda pid: pid != "p1")
    assert admitted == ["p0", "p1", "p2"]
    assert effects == [core.EndOfData(step=0, accepted=2, target=4, prompts_consumed=3,
                                      rejected_by_reason={"zero_std": 1})]
    assert state.ended and not core.can_admit(state, lim)
    # nothing more: a later check, the marker again (a redelivery) or another marker
    assert core.check_step(state, lim)[1] == []
    assert core.on_data_end(state, lim, 3, 2)[1] == []
    assert core.on_data_end(state, lim, 9, 2)[1] == [core.ExtraEnd(9)]


def test_two_epochs_verdict_counts_the_last_step():
    lim = limits(num_epochs=2)
    _, admitted, effects = simulate(lim, ["p0", "p1", "p2"])
    assert admitted == ["p0", "p1", "p2", "p0#e1", "p1#e1", "p2#e1"]
    assert effects == [core.StepComplete(0, 2, 2, {}), core.StepComplete(1, 2, 2, {}), core.StepComplete(2, 2, 2, {}),
                       core.EndOfData(step=3, accepted=0, target=2, prompts_consumed=0, rejected_by_reason={})]


def test_a_step_completed_on_the_last_prompt_ends_with_zero_accepted_or_no_verdict_at_max_steps():
    _, _, effects = simulate(limits(), ["p0", "p1", "p2", "p3"])
    assert effects[-1] == core.EndOfData(step=2, accepted=0, target=2, prompts_consumed=0, rejected_by_reason={})
    assert len(effects) == 3
    # max_steps batches are complete: admission is finished, the trainer ends on its step count
    state, _, effects = simulate(limits(max_steps=2), ["p0", "p1", "p2", "p3"])
    assert effects == [core.StepComplete(0, 2, 2, {}), core.StepComplete(1, 2, 2, {})]
    assert state.finished and not state.ended


def test_the_verdict_waits_for_validation_prompts_in_flight():
    lim = limits()
    state = core.AdmissionState()
    core.admit(state, "v0", "val")
    state, effects = core.on_data_end(state, lim, 1, 0)
    assert effects == [] and core.data_done(state, lim)
    state, effects = core.on_outcome(state, lim, "v0", True, "accepted")
    assert effects == [core.EndOfData(0, 0, 2, 0, {})]


def test_a_restarted_admission_resumes_mid_epoch_without_duplicates_or_gaps():
    lim = limits(num_epochs=3)
    prompts = ["p0", "p1", "v0", "p2", "p3"]
    _, expected, expected_effects = simulate(lim, prompts)
    for crash_after in range(len(prompts) + 1, len(expected)):
        state, before = core.AdmissionState(), []
        with pytest.raises(Crash, match=f"crashed after admitting {crash_after}$"):
            simulate(lim, prompts, state=state, crash_after=crash_after, admitted=before)
        saved = json.loads(json.dumps(state.to_dict()))  # the table entry as last saved
        restored = core.AdmissionState.from_dict(saved)
        assert restored == state
        _, after, _ = simulate(lim, prompts, state=restored)
        assert before + after == expected, crash_after
    assert sum(isinstance(e, core.EndOfData) for e in expected_effects) == 1


def test_a_state_saved_before_epochs_existed_still_loads():
    old = {"step": 3, "in_flight": {"p9": 3}, "admitted_in_step": 1, "accepted_in_step": 0,
           "rejected_in_step": {}, "prompts_admitted": 13, "val_admitted": 0, "finished": False}
    state = core.AdmissionState.from_dict(old)
    assert (state.epoch, state.epoch_position, state.end_offset, state.ended) == (0, 0, None, False)


def test_no_prompt_to_take_is_an_error():
    with pytest.raises(ValueError, match="no epoch prompt left"):
        core.take_replay(core.AdmissionState(), limits())
    with pytest.raises(ValueError, match="num_epochs"):
        limits(num_epochs=0)
