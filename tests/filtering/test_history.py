"""The history-aware admission's rule (rollstream.filtering.history, GRESO) on scripted histories."""

from __future__ import annotations

import pytest

from rollstream.filtering import admission as core
from rollstream.filtering import history as h

LIMITS = h.HistoryLimits(explore_init=0.5, explore_min=0.05, step=0.01, window=8, max_skips=3, seed=7)


def hist(*patterns: str, skips: int = 0) -> h.PromptHistory:
    return h.PromptHistory("p", [{"epoch": e, "pattern": p, "policy_version": e} for e, p in enumerate(patterns)], skips)


@pytest.mark.parametrize("rewards, pattern", [
    ([1.0, 1.0, 1.0], "all_correct"), ([0.0, 0.0], "all_wrong"), ([-1.0, -1.0], "all_wrong"),
    ([1.0, 0.0, 1.0], "mixed"), ([0.5, 0.5 + 1e-12], "all_correct"), ([], ""), ([1.0, float("nan")], ""),
])
def test_reward_pattern(rewards, pattern):
    assert h.reward_pattern(rewards) == pattern


def test_split_epoch_inverts_the_epoch_transaction_id():
    assert h.split_epoch(core.epoch_prompt_id("gsm8k-12", 3)) == ("gsm8k-12", 3)
    assert h.split_epoch("gsm8k-12") == ("gsm8k-12", 0)
    assert h.split_epoch("a#eb") == ("a#eb", 0)  # not an epoch suffix


@pytest.mark.parametrize("patterns, explore, expected", [
    ((), 0.5, 0.0),                                           # no history: never skipped
    (("mixed",), 0.5, 0.0),                                   # informative last time
    (("all_correct",), 0.5, 0.5),                             # z = 1: 1 - 0.5
    (("mixed", "all_correct", "all_correct"), 0.5, 0.75),     # z = 2: 1 - 0.5^2
    (("all_wrong", "mixed", "all_wrong"), 0.5, 0.5),          # the streak restarts after a mixed group
    (("all_correct",) * 3, 0.2, 1 - 0.2 ** 3),
])
def test_skip_probability_is_one_minus_explore_to_the_zero_variance_streak(patterns, explore, expected):
    state = h.ExploreState({"all_correct": explore, "all_wrong": explore}, [])
    assert h.skip_probability(hist(*patterns), state)[0] == pytest.approx(expected)


def test_the_chance_to_come_back_rises_with_each_epoch_skipped():
    state = h.ExploreState({"all_correct": 0.2, "all_wrong": 0.2}, [])
    probabilities = [h.skip_probability(hist("all_wrong", skips=s), state)[0] for s in range(4)]
    assert probabilities == pytest.approx([0.8, 0.8 ** 2, 0.8 ** 3, 0.8 ** 4])


def test_a_screened_out_group_enters_the_history_as_zero_variance():
    """Screening decides from k samples: the outcome it writes carries their pattern, so the
    history filter learns from k samples what it learns from a full group."""
    from rollstream.filtering.prompt_state import Decided, DomainFilters, step
    from rollstream.streams.event_builders import prompt_outcome
    from tests.filtering.test_prompt_state import rr

    filters = DomainFilters(num_return_sequences=8, screening_samples=2,
                            query_filter_config={"type": "std_filter", "filter_args": {"std_threshold": 0.0}})
    state, effects = step(None, rr(0, 0.0), filters)
    state, effects = step(state, rr(1, 0.0), filters)
    (decided,) = [e for e in effects if isinstance(e, Decided)]
    outcome = prompt_outcome({"prompt_id": "p#e1", "domain": "d"}, committed=False, reason=decided.reason,
                             rounds=decided.rounds, responses_generated=decided.responses_generated,
                             policy_version=decided.policy_version, rewards=decided.rewards)
    assert (outcome["reason"], outcome["reward_pattern"], outcome["responses_generated"]) == ("screened_out", "all_wrong", 2)


def test_the_class_of_the_latest_entry_sets_the_explore_probability():
    state = h.ExploreState({"all_correct": 0.1, "all_wrong": 0.9}, [])
    assert h.skip_probability(hist("all_wrong", "all_correct"), state) == (pytest.approx(1 - 0.1 ** 2), 2, 0.1)
    assert h.skip_probability(hist("all_correct", "all_wrong"), state) == (pytest.approx(1 - 0.9 ** 2), 2, 0.9)


def test_skips_are_drawn_with_the_probability_and_deterministically():
    state = h.ExploreState.initial(LIMITS)
    past = hist("all_correct", "all_correct")  # skip probability 0.75
    decisions = [h.decide_skip(past, state, LIMITS, f"p{i}", 2) for i in range(4000)]
    share = sum(d.skip for d in decisions) / len(decisions)
    assert share == pytest.approx(0.75, abs=0.03)
    assert [d.skip for d in decisions[:50]] == [h.decide_skip(past, state, LIMITS, f"p{i}", 2).skip for i in range(50)]
    assert decisions[0].values()["skip_probability"] == 0.75
    assert h.decide_skip(past, state, LIMITS, "p0", 0).skip is False  # epoch 0 has no history to act on


def test_max_skips_admits_a_prompt_skipped_that_many_epochs_back_to_back():
    state = h.ExploreState({"all_correct": LIMITS.explore_min, "all_wrong": LIMITS.explore_min}, [])
    past = hist("all_correct", "all_correct", skips=3)  # skip probability 0.9975, but skipped 3 times already
    decision = h.decide_skip(past, state, LIMITS, "p", 5)
    assert (decision.skip, decision.forced) == (False, True)


def test_exploration_keeps_every_prompt_reachable():
    """A population that is always all-correct, at the floor of exploration, over 30 epochs: no
    prompt goes more than max_skips epochs without being generated, and every skip is counted."""
    state = h.ExploreState({"all_correct": LIMITS.explore_min, "all_wrong": LIMITS.explore_min}, [])
    histories = {f"p{i}": h.PromptHistory(f"p{i}") for i in range(40)}
    generated = {pid: [] for pid in histories}
    skipped = 0
    for epoch in range(30):
        for pid, past in histories.items():
            decision = h.decide_skip(past, state, LIMITS, pid, epoch)
            if decision.skip:
                h.on_skip(past)
                skipped += 1
                continue
            generated[pid].append(epoch)
            past.record(epoch, "all_correct", epoch)
    for pid, epochs in generated.items():
        assert epochs[0] == 0
        gaps = [b - a - 1 for a, b in zip(epochs, epochs[1:])] + [29 - epochs[-1]]
        assert max(gaps) <= LIMITS.max_skips, (pid, epochs)
    assert skipped == 40 * 30 - sum(len(e) for e in generated.values()) > 40 * 20  # most epochs are skipped


PACED = h.HistoryLimits(explore_init=0.5, explore_min=0.05, step=0.01, window=8, max_skips=3, revisit_versions=8,
                        seed=7)


@pytest.mark.parametrize("elapsed, expected", [(0, 1.0), (4, 0.5 ** 0.375), (8, 0.5), (16, 0.5 ** 3), (24, 0.5 ** 6)])
def test_paced_by_versions_the_whole_epochs_match_the_epoch_rule(elapsed, expected):
    """S(E) = P ** (x (x + 1) / 2), x = E / H: one epoch's worth of versions gives the epoch rule's
    P, two give P * P ** 2 (skipped twice in a row), three P ** 6."""
    assert h.still_skipped(0.5, elapsed, 8) == pytest.approx(expected)


def test_paced_by_versions_a_prompt_comes_back_at_a_seeded_age_however_often_it_is_drawn():
    """One uniform per streak decides: a prompt drawn in epoch after epoch at one version is
    skipped each time (nothing changed), and the share revisited by one epoch's worth of
    versions is 1 - P."""
    state = h.ExploreState.initial(PACED)  # p_e 0.5: P = 0.5 for z = 1
    past = h.PromptHistory("p", [{"epoch": 1, "pattern": "all_wrong", "policy_version": 3}])
    same_version = [h.decide_skip(past, state, PACED, "p", epoch, policy_version=3) for epoch in (2, 3, 4)]
    assert [(d.skip, d.probability, d.values()["versions_elapsed"]) for d in same_version] == [(True, 1.0, 0.0)] * 3
    assert len({d.draw for d in same_version}) == 1  # the streak's draw, not the epoch's
    populations = [h.PromptHistory(f"p{i}", [{"epoch": 1, "pattern": "all_wrong", "policy_version": 3}])
                   for i in range(4000)]
    back = [not h.decide_skip(q, state, PACED, q.prompt_id, 9, policy_version=3 + 8).skip for q in populations]
    assert sum(back) / len(back) == pytest.approx(0.5, abs=0.03)
    # a prompt that comes back at E comes back at every later E too: S falls as E grows
    ages = [next(e for e in range(40) if not h.decide_skip(q, state, PACED, q.prompt_id, 2, 3 + e).skip)
            for q in populations[:200]]
    assert all(not h.decide_skip(q, state, PACED, q.prompt_id, 2, 3 + a + 1).skip for q, a in zip(populations, ages))


def test_paced_by_versions_only_the_policys_change_counts_not_the_epochs_skipped():
    state = h.ExploreState.initial(PACED)
    past = h.PromptHistory("p", [{"epoch": 1, "pattern": "all_wrong", "policy_version": 3}], skips=40)
    decision = h.decide_skip(past, state, PACED, "p", 42, policy_version=3)
    assert (decision.skip, decision.forced, decision.elapsed, decision.probability) == (True, False, 0, 1.0)


def test_paced_by_versions_max_skips_admits_after_that_many_epochs_worth_of_versions():
    state = h.ExploreState({"all_correct": PACED.explore_min, "all_wrong": PACED.explore_min}, [])
    past = h.PromptHistory("p", [{"epoch": 0, "pattern": "all_correct", "policy_version": 0},
                                 {"epoch": 1, "pattern": "all_correct", "policy_version": 3}], skips=2)
    before = h.decide_skip(past, state, PACED, "p", 4, policy_version=3 + 23)  # E = 23: S = 0.9975 ** 5.57
    assert (before.skip, before.probability) == (True, pytest.approx(0.9975 ** (23 / 8 * (23 / 8 + 1) / 2)))
    decision = h.decide_skip(past, state, PACED, "p", 4, policy_version=3 + 24)  # E = 24
    assert (decision.skip, decision.forced, decision.elapsed) == (False, True, 24)


def test_paced_by_versions_a_mixed_last_outcome_is_never_skipped():
    past = h.PromptHistory("p", [{"epoch": 1, "pattern": "all_wrong", "policy_version": 0},
                                 {"epoch": 2, "pattern": "mixed", "policy_version": 2}])
    decision = h.decide_skip(past, h.ExploreState.initial(PACED), PACED, "p", 3, policy_version=2)
    assert (decision.skip, decision.probability) == (False, 0.0)


def test_observe_steers_each_explore_probability_to_its_target_share():
    state = h.ExploreState.initial(LIMITS)
    for _ in range(10):  # all-correct groups only: their share (1.0) is above target, all-wrong's (0) below
        h.observe(state, LIMITS, "all_correct")
    assert state.explore == {"all_correct": pytest.approx(0.5 - 0.1), "all_wrong": pytest.approx(0.5 + 0.1)}
    assert state.recent == ["all_correct"] * LIMITS.window
    for _ in range(100):
        h.observe(state, LIMITS, "all_correct")
    assert state.explore == {"all_correct": LIMITS.explore_min, "all_wrong": 1.0}  # clamped to [explore_min, 1]
    h.observe(state, LIMITS, "no such pattern")
    assert len(state.recent) == LIMITS.window


def test_a_redelivered_outcome_of_an_epoch_changes_no_history():
    past = hist("all_correct", skips=2)
    past.record(1, "all_wrong", 4)
    past.record(1, "mixed", 4)
    assert [e["pattern"] for e in past.entries] == ["all_correct", "all_wrong"]
    assert past.skips == 0
    assert h.PromptHistory.from_record(past.to_record()) == past


@pytest.mark.parametrize("bad, message", [
    (dict(explore_min=0.0), "explore_min <= explore_init <= 1, got 0.0, 0.5"),
    (dict(explore_min=0.6), "explore_min <= explore_init <= 1, got 0.6, 0.5"),
    (dict(window=0), "window must be >= 1"),
    (dict(target_all_wrong=2.0), r"target_all_wrong must be in \[0, 1\], got 2.0"),
    (dict(revisit_versions=-1), "revisit_versions >= 0"),
])
def test_absurd_limits_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        h.HistoryLimits(**bad)


# -- the admission's part: validation rounds, skips --------------------------------------------

ADMISSION = core.AdmissionLimits(rollout_batch_size=2, max_running_prompts=4, max_prompts_per_batch=8, eval_steps=2)


@pytest.mark.parametrize("last, size, position, version, due", [
    (0, 0, 0, None, None),   # nothing published
    (0, 0, 0, 1, None),      # 1 // 2 == 0 // 2: the round of version 0 covers it
    (0, 0, 0, 2, 2),
    (0, 0, 0, 3, 3),         # admission saw 3 first: the round runs for the version that is current
    (2, 5, 5, 3, None),
    (2, 5, 5, 4, 4),
    (2, 5, 3, 4, None),      # the round of version 2 is still being admitted
])
def test_eval_due(last, size, position, version, due):
    state = core.AdmissionState(eval_version=last, eval_size=size, eval_position=position)
    assert core.eval_due(state, ADMISSION, version) == due


def test_a_validation_round_is_admitted_in_order_and_holds_the_end_of_data():
    limits = core.AdmissionLimits(rollout_batch_size=2, max_running_prompts=4, max_prompts_per_batch=8,
                                  eval_steps=2, max_steps=5)
    state = core.start_eval(core.AdmissionState(end_offset=3, epoch=1), 2, 2)  # the data ended, no train prompt
    assert core.next_eval(state) == 0
    core.admit(core.take_eval(state), core.eval_prompt_id("v0", 2), "val")
    assert core.check_step(state, limits)[1] == []  # a round prompt still to admit: no verdict yet
    core.admit(core.take_eval(state), core.eval_prompt_id("v1", 2), "val")
    assert core.next_eval(state) is None
    with pytest.raises(ValueError, match="no validation prompt left to take"):
        core.take_eval(state)
    state, _ = core.on_outcome(state, limits, "v0#v2", True, "accepted")
    state, effects = core.on_outcome(state, limits, "v1#v2", True, "accepted")
    assert [type(e).__name__ for e in effects] == ["EndOfData"]
    assert core.eval_version_of("v1#v2") == 2 and core.eval_version_of("v1") == 0


def test_a_skipped_prompt_takes_no_slot_and_no_budget():
    state = core.skip_by_history(core.AdmissionState())
    assert (state.skipped_by_history, state.admitted_in_step, state.in_flight) == (1, 0, {})


def test_a_pass_is_done_when_every_train_prompt_was_skipped_at_one_version():
    state = core.AdmissionState(epoch_size=3)
    for _ in range(2):
        core.skip_by_history(state, version=4)
    assert not core.history_pass_done(state, 4)
    core.skip_by_history(state, version=4)
    assert core.history_pass_done(state, 4) and not core.history_pass_done(state, 5)  # a new version: judge again
    core.skip_by_history(state, version=5)
    assert (state.skip_run, state.skip_run_version, state.skipped_by_history) == (1, 5, 4)  # the run restarts
    core.skip_by_history(state, version=5)
    core.admit(state, "p#e2")
    core.skip_by_history(state, version=5)
    assert core.history_pass_done(state, 5)  # an admission between the skips at one version changes nothing
