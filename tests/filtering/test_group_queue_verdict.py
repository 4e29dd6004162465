"""The group queue's two-step decision: on_trajectory asks (NeedsDecision), on_verdict applies."""

from __future__ import annotations

import json

import pytest

from rollstream.filtering.group_queue import (
    GroupDecided,
    NeedsDecision,
    QueueDone,
    QueueParams,
    QueueState,
    SetAside,
    StartRun,
    Verdict,
    on_tick,
    on_trajectory,
    on_verdict,
    start,
)

DROP = Verdict(drop=True, reason="zero_std", values={"std": 0.0})


def test_complete_members_ask_for_a_decision_and_change_nothing_yet():
    params = QueueParams(group_size=2, group_size_redundancy=1)
    state, _ = start("train", 0, 0, params, 0)
    state, effects = on_trajectory(state, params, 0, 2, False, 0, 0)
    assert effects == []
    same, effects = on_trajectory(state, params, 0, 0, False, 0, 0)
    assert same is state and effects == [NeedsDecision(0, (2, 0))]  # arrival order
    assert list(state.open) == [0] and (state.accepted, state.rejected) == (0, 0)


def test_keep_verdict_emits_the_named_members():
    params = QueueParams(group_size=2, group_size_redundancy=1, episodes_target=1)
    state, _ = start("train", 5, 0, params, 0)
    on_trajectory(state, params, 0, 1, False, 0, 0)
    _, (need,) = on_trajectory(state, params, 0, 0, False, 0, 0)
    same, effects = on_verdict(state, params, need.episode_id, Verdict(drop=False, values={"std": 0.5}), 7)
    assert same is state
    assert effects == [GroupDecided(episode_id=0, accepted=True, reason="accepted", members=(1, 0),
                                    values={"std": 0.5}, started=3, arrived=2, refills=0, reissues=0,
                                    replaced_by=None),
                       QueueDone("complete", 1, 0)]
    assert state.closed[0].pending == 1  # the redundant run is still on its way
    assert state.rejected_by_reason == {}


def test_drop_verdict_replaces_the_episode_and_counts_its_reason():
    params = QueueParams(group_size=1, episodes_target=1, max_replaced_episodes=1)
    state, _ = start("train", 0, 100, params, 0)
    _, (need,) = on_trajectory(state, params, 0, 0, False, 0, 0)
    _, effects = on_verdict(state, params, need.episode_id, DROP, 0)
    (d,) = [e for e in effects if isinstance(e, GroupDecided)]
    assert (d.accepted, d.reason, d.values, d.replaced_by) == (False, "zero_std", {"std": 0.0}, 1)
    assert [e for e in effects if isinstance(e, StartRun)] == [StartRun(1, 0, 101, "start")]
    _, (need,) = on_trajectory(state, params, 1, 0, False, 0, 0)
    _, effects = on_verdict(state, params, need.episode_id, DROP, 0)
    assert effects[-1] == QueueDone("exhausted", 0, 1)
    assert (state.rejected, state.rejected_by_reason) == (2, {"zero_std": 2})


def test_need_decision_comes_last_after_a_set_aside():
    """A set-aside run that leaves a smaller valid group (min_valid_group_size, no refill left)."""
    params = QueueParams(group_size=2, max_refills_per_group=0, min_valid_group_size=1)
    state, _ = start("train", 0, 0, params, 0)
    on_trajectory(state, params, 0, 0, False, 0, 0)
    _, effects = on_trajectory(state, params, 0, 1, False, 0, 0, invalid="invalid_reward")
    assert effects == [SetAside(0, 1, "invalid_reward"), NeedsDecision(0, (0,))]


def test_a_verdict_nobody_asked_for_is_refused():
    params = QueueParams(group_size=2)
    state, _ = start("train", 0, 0, params, 0)
    with pytest.raises(ValueError, match="awaits no decision"):
        on_verdict(state, params, 0, DROP, 0)  # one member missing
    on_trajectory(state, params, 0, 0, False, 0, 0)
    on_trajectory(state, params, 0, 1, False, 0, 0)
    on_verdict(state, params, 0, DROP, 0)
    with pytest.raises(ValueError, match="awaits no decision"):
        on_verdict(state, params, 0, DROP, 0)  # applied twice: the episode is closed


def test_reasons_outside_the_filter_are_counted_too():
    """refill_exhausted (on_trajectory) and episode_timeout (on_tick) close without a verdict."""
    params = QueueParams(group_size=1, max_refills_per_group=0, episode_timeout_ms=10,
                         max_reissues_per_episode=0, max_replaced_episodes=2)
    state, _ = start("train", 0, 0, params, 0)
    _, effects = on_trajectory(state, params, 0, 0, True, 0, 0)
    assert [type(e) for e in effects] == [SetAside, GroupDecided, StartRun]
    same, effects = on_tick(state, params, 10)
    assert same is state and [e.reason for e in effects if isinstance(e, GroupDecided)] == ["episode_timeout"]
    assert state.rejected_by_reason == {"refill_exhausted": 1, "episode_timeout": 1}


def test_state_written_before_rejected_by_reason_existed_still_loads():
    params = QueueParams(group_size=1)
    state, _ = start("train", 3, 9, params, 0)
    old = json.loads(json.dumps(state.to_dict()))
    del old["rejected_by_reason"]
    loaded = QueueState.from_dict(old)
    assert loaded == state and loaded.rejected_by_reason == {}
