"""The group queue state machine (rollstream.filtering.group_queue), no Kafka."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollstream.filtering.group_queue import (
    Duplicate,
    GroupDecided,
    Late,
    NeedsDecision,
    QueueDone,
    QueueParams,
    QueueState,
    RedundancySaved,
    SetAside,
    StartRun,
    Verdict,
    on_tick,
    on_trajectory,
    on_verdict,
    start,
)

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "roll_reference_vectors.json").read_text())

KEEP = Verdict(drop=False)


def runs(effects) -> list[tuple[int, int, str]]:
    return [(e.episode_id, e.traj_index, e.cause) for e in effects if isinstance(e, StartRun)]


def decided(effects) -> list[GroupDecided]:
    return [e for e in effects if isinstance(e, GroupDecided)]


class Script:
    """A decide callback that drops the scripted episodes and records every call."""

    def __init__(self, drop: set[int] = frozenset()) -> None:
        self.drop = set(drop)
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, episode_id: int, members: list[int]) -> Verdict:
        self.calls.append((episode_id, list(members)))
        if episode_id in self.drop:
            return Verdict(drop=True, reason="group_filter", values={"scripted": 1.0})
        return KEEP


def arrive(state, params, episode_id, traj_index, decide, infra_failed=False, finished_ms=0, now_ms=0):
    """on_trajectory, then ``decide`` (the group filter) for a NeedsDecision, applied with
    on_verdict in its place: the effects as one list, as the processor carries them out."""
    state, effects = on_trajectory(state, params, episode_id, traj_index, infra_failed, finished_ms, now_ms)
    out = []
    for effect in effects:
        if isinstance(effect, NeedsDecision):
            out += on_verdict(state, params, effect.episode_id, decide(effect.episode_id, list(effect.members)),
                              now_ms)[1]
        else:
            out.append(effect)
    return out


def tick(state, params, now_ms):
    """on_tick's effects (the state changes in place)."""
    return on_tick(state, params, now_ms)[1]


def test_reference_lifecycle_group_size_2_redundancy_1():
    """reference vector group_queue_lifecycle: ep0 dropped and replaced by ep2, ep0's late run
    ignored, ep1 kept exactly once. We differ where documented: ep1's third run arrives after the
    group was emitted, so it is late (the reference appends it until get())."""
    vec = VECTORS["group_queue"]
    p = vec["params"]
    params = QueueParams(group_size=p["group_size"], group_size_redundancy=p["group_size_redundancy"],
                         max_traj_per_env=p["max_traj_per_env"], episodes_target=2)
    state, effects = start("train", 7, 1000, params, now_ms=0)
    handouts = [e for e, _, _ in runs(effects)]
    assert handouts == vec["log"][1]["returned"] == [0, 0, 0, 1, 1, 1]
    assert {e.seed for e in effects if e.episode_id == 0} == {1000}
    assert {e.seed for e in effects if e.episode_id == 1} == {1001}
    assert state.next_episode_id == 2

    script = Script(drop={0})
    assert arrive(state, params, 0, 0, script) == []
    out = arrive(state, params, 0, 1, script)
    (d,) = decided(out)
    assert (d.episode_id, d.accepted, d.reason, d.members, d.replaced_by) == (0, False, "group_filter", (0, 1), 2)
    assert runs(out) == [(2, 0, "start"), (2, 1, "start"), (2, 2, "start")]
    assert script.calls == [(0, [0, 1])]  # filter ran once, at the group_size-th arrival
    assert sorted(state.open) == [1, 2] and state.next_episode_id == 3 and state.replaced == 1

    out = arrive(state, params, 0, 2, script, finished_ms=5_000)  # late redundant run of the dropped episode
    assert out == [Late(0, 2), RedundancySaved(0, 5_000)]
    assert state.late == 1

    arrive(state, params, 1, 2, script)
    out = arrive(state, params, 1, 0, script)
    (d,) = decided(out)
    assert (d.episode_id, d.accepted, d.members) == (1, True, (2, 0))  # arrival order
    assert script.calls == [(0, [0, 1]), (1, [2, 0])]
    assert arrive(state, params, 1, 1, script) == [Late(1, 1), RedundancySaved(1, 0)]
    assert arrive(state, params, 1, 1, script) == [Late(1, 1)]  # redelivered late run: still only counted
    assert state.late == 3


def test_duplicate_and_unknown_runs_are_not_members():
    params = QueueParams(group_size=2, group_size_redundancy=1)
    state, _ = start("train", 0, 0, params, 0)
    script = Script()
    assert arrive(state, params, 0, 0, script) == []
    assert arrive(state, params, 0, 0, script) == [Duplicate(0, 0)]
    assert arrive(state, params, 0, 9, script) == [Duplicate(0, 9)]  # never issued
    assert script.calls == []


def test_groups_never_wait_for_each_other():
    """Episodes 0 and 1 open at once; 0 stays incomplete while 1 is emitted (no head-of-line blocking)."""
    params = QueueParams(group_size=2, max_traj_per_env=2, episodes_target=2)
    state, _ = start("train", 0, 0, params, 0)
    script = Script()
    arrive(state, params, 0, 0, script)
    out = arrive(state, params, 1, 0, script) + arrive(state, params, 1, 1, script)
    assert [(d.episode_id, d.accepted) for d in decided(out)] == [(1, True)]
    assert list(state.open) == [0]


def test_completion_and_queue_done():
    params = QueueParams(group_size=2, episodes_target=2)
    state, _ = start("train", 3, 10, params, 0)
    script = Script()
    arrive(state, params, 0, 0, script)
    out = arrive(state, params, 0, 1, script)
    assert runs(out) == [(1, 0, "start"), (1, 1, "start")]  # next episode of the target, not a replacement
    assert state.replaced == 0
    arrive(state, params, 1, 0, script)
    out = arrive(state, params, 1, 1, script)
    assert out[-1] == QueueDone("complete", 2, 0)
    assert state.status == "complete" and state.open == {}


def test_replacements_are_bounded_then_exhausted():
    params = QueueParams(group_size=1, episodes_target=1, max_replaced_episodes=2)
    state, _ = start("train", 0, 0, params, 0)
    script = Script(drop={0, 1, 2})
    for eid in (0, 1, 2):
        out = arrive(state, params, eid, 0, script)
    assert [d.replaced_by for d in decided(out)] == [None]
    assert out[-1] == QueueDone("exhausted", 0, 2)
    assert state.next_episode_id == 3  # 1 + 2 replacements, never a 4th episode


def test_refill_per_sample():
    """G = 8, episode 3 of group 7: run 5 is lost; exactly one refill with the same seed, the
    group stays open, the refill lands and the group closes with 8 valid trajectories."""
    params = QueueParams(group_size=8, max_refills_per_group=2, episodes_target=4)
    state, _ = start("train", 7, 500, params, 0)
    state.open.clear()
    state.next_episode_id = 3
    from rollstream.filtering.group_queue import _open_episode  # the 4th episode of this group id
    _open_episode(state, params, 0, [])
    script = Script()
    for t in (0, 1, 2, 3, 4):
        assert arrive(state, params, 3, t, script) == []
    out = arrive(state, params, 3, 5, script, infra_failed=True)
    assert out == [SetAside(3, 5, "infra_abort"), StartRun(3, 8, 503, "refill")]
    for t in (6, 7):
        assert arrive(state, params, 3, t, script) == []
    out = arrive(state, params, 3, 8, script)
    (d,) = decided(out)
    assert (d.accepted, d.members, d.refills) == (True, (0, 1, 2, 3, 4, 6, 7, 8), 1)
    assert script.calls == [(3, [0, 1, 2, 3, 4, 6, 7, 8])]


@pytest.mark.parametrize("min_valid, expected", [(None, (False, "refill_exhausted", 7)), (7, (True, "accepted", 7))])
def test_both_refills_fail(min_valid, expected):
    params = QueueParams(group_size=8, max_refills_per_group=2, min_valid_group_size=min_valid)
    state, _ = start("train", 7, 500, params, 0)
    script = Script()
    for t in (0, 1, 2, 3, 4, 6, 7):
        arrive(state, params, 0, t, script)
    assert runs(arrive(state, params, 0, 5, script, infra_failed=True)) == [(0, 8, "refill")]
    assert runs(arrive(state, params, 0, 8, script, infra_failed=True)) == [(0, 9, "refill")]
    out = arrive(state, params, 0, 9, script, infra_failed=True)
    (d,) = decided(out)
    assert (d.accepted, d.reason, len(d.members)) == expected
    assert d.refills == 2 and not [r for r in runs(out) if r[2] == "refill"]
    assert script.calls == ([] if min_valid is None else [(0, [0, 1, 2, 3, 4, 6, 7])])


def test_redundancy_absorbs_an_infra_failure_without_refill():
    params = QueueParams(group_size=2, group_size_redundancy=1)
    state, _ = start("train", 0, 0, params, 0)
    out = arrive(state, params, 0, 0, Script(), infra_failed=True)
    assert out == [SetAside(0, 0, "infra_abort")]  # runs 1 and 2 can still make the group


def test_refill_disabled_keeps_infra_failures_as_members():
    """The reference's behaviour: the group filter sees the failed trajectory."""
    params = QueueParams(group_size=2, refill_enabled=False)
    state, _ = start("train", 0, 0, params, 0)
    script = Script(drop={0})
    arrive(state, params, 0, 0, script, infra_failed=True)
    out = arrive(state, params, 0, 1, script)
    assert [(d.accepted, d.members) for d in decided(out)] == [(False, (0, 1))]
    assert runs(out) == [(1, 0, "start"), (1, 1, "start")]


def test_deadline_reissues_missing_runs_then_times_out():
    params = QueueParams(group_size=3, episode_timeout_ms=1000, max_reissues_per_episode=1, max_replaced_episodes=1)
    state, _ = start("train", 0, 40, params, 0)
    script = Script()
    arrive(state, params, 0, 0, script)
    assert tick(state, params, 999) == []
    out = tick(state, params, 1000)
    assert runs(out) == [(0, 3, "reissue"), (0, 4, "reissue")]
    assert all(e.seed == 40 for e in out)
    assert tick(state, params, 1999) == []
    out = tick(state, params, 2000)
    (d,) = decided(out)
    assert (d.episode_id, d.accepted, d.reason, d.reissues, d.replaced_by) == (0, False, "episode_timeout", 1, 1)
    assert runs(out) == [(1, 0, "start"), (1, 1, "start"), (1, 2, "start")]


def test_reissued_run_completes_the_group():
    params = QueueParams(group_size=2, episode_timeout_ms=100)
    state, _ = start("train", 0, 0, params, 0)
    script = Script()
    arrive(state, params, 0, 0, script)
    tick(state, params, 100)
    out = arrive(state, params, 0, 2, script)  # the reissue arrives, run 1 never does
    assert [(d.accepted, d.members) for d in decided(out)] == [(True, (0, 2))]


def test_state_round_trips_through_json():
    params = QueueParams(group_size=2, group_size_redundancy=1, max_traj_per_env=2, episodes_target=3)
    state, _ = start("val", 4, 9, params, 0, partition=2)
    arrive(state, params, 0, 0, Script())
    arrive(state, params, 1, 1, Script(), infra_failed=True)
    again = QueueState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_to_dict_is_asdict_a_copy_and_round_trips():
    """The hand-built to_dict gives exactly what dataclasses.asdict gives (open and closed
    episodes, counts by reason), shares no list or dict with the state, and survives JSON."""
    from dataclasses import asdict

    params = QueueParams(group_size=2, group_size_redundancy=1, max_traj_per_env=2, episodes_target=4)
    state, _ = start("train", 3, 100, params, 0, partition=1)
    decide = Script(drop={0})
    for eid, tix, infra in ((0, 0, False), (0, 1, False), (1, 0, True), (1, 1, False)):
        arrive(state, params, eid, tix, decide, infra_failed=infra, finished_ms=5, now_ms=7)  # in place
    assert state.closed and state.open and state.rejected_by_reason  # every part is populated
    d = state.to_dict()
    assert d == asdict(state)
    d["open"][1]["issued"].append(99)
    d["rejected_by_reason"]["x"] = 1
    assert 99 not in state.open[1].issued and "x" not in state.rejected_by_reason
    assert QueueState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
