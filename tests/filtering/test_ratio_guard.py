"""DropFlagRatioGuard: the cumulative mode against every executed reference call, the strict window
mode against its invariants."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest

from rollstream.filtering import DropFlagRatioGuard

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "roll_reference_vectors.json").read_text())
SEQUENCES = VECTORS["drop_flag_ratio_guard"]


@pytest.mark.parametrize("sequence", SEQUENCES, ids=[s["name"] for s in SEQUENCES])
def test_cumulative_matches_every_reference_call(sequence):
    guard = DropFlagRatioGuard()  # cumulative, 0.5: the reference's guard
    assert [int(c["candidate"]) for c in sequence["calls"]] == sequence["pattern"]
    for call in sequence["calls"]:
        assert {"total": guard.total, "filtered": guard.filtered} == call["stats_before"], call["call"]
        assert guard.decide(call["candidate"]) is call["returned_drop"], call["call"]
        assert {"total": guard.total, "filtered": guard.filtered} == call["stats_after"], call["call"]


def test_vectors_cover_the_documented_sequences():
    assert len(SEQUENCES) == 4 and sum(len(s["calls"]) for s in SEQUENCES) == 40


def test_cumulative_alternating_pattern_from_the_reference_table():
    # the reference's alternating pattern (not in the vectors file): 0 1 0 1 ... drops each candidate
    guard = DropFlagRatioGuard()
    out = [guard.decide(bool(i % 2)) for i in range(10)]
    assert out == [False, True] * 5
    assert (guard.total, guard.filtered) == (10, 5)


def test_cumulative_first_candidate_dropped_at_call_two_and_kept_at_call_one():
    guard = DropFlagRatioGuard()
    assert guard.decide(True) is False  # 1/1 > 0.5
    guard = DropFlagRatioGuard()
    assert guard.decide(False) is False
    assert guard.decide(True) is True  # 1/2 = 0.5 is not > 0.5


def test_cumulative_other_ratios_and_never_resets():
    guard = DropFlagRatioGuard("cumulative", max_ratio=0.25)
    out = [guard.decide(True) for _ in range(8)]
    # drop iff (filtered + 1) / total <= 0.25
    assert out == [False, False, False, True, False, False, False, True]
    assert (guard.total, guard.filtered) == (8, 2)
    # a long clean stretch lets the cumulative guard drop a burst: it bounds the whole-run share only
    guard = DropFlagRatioGuard("cumulative", 0.5)
    for _ in range(20):
        guard.decide(False)
    burst = [guard.decide(True) for _ in range(20)]
    assert burst == [True] * 20
    assert (guard.total, guard.filtered) == (40, 20)
    assert guard.decide(True) is False
    assert [DropFlagRatioGuard("cumulative", 0.0).decide(True) for _ in range(3)] == [False] * 3
    always = DropFlagRatioGuard("cumulative", 1.0)
    assert [always.decide(True) for _ in range(3)] == [True] * 3
    assert always.decide(False) is False and (always.total, always.filtered) == (4, 3)


def _limit(max_ratio: float, length: int) -> int:
    """Drops allowed in `length` decisions: the largest k with k / length <= max_ratio, compared in
    floats as the guard documents (so 0.3 over 10 allows 3 although Fraction(0.3) * 10 < 3)."""
    return max(k for k in range(length + 1) if k / length <= max_ratio)


def test_limit_is_floor_of_ratio_times_window_for_exact_ratios():
    for max_ratio, window in [(0.5, 10), (0.25, 8), (0.0, 5), (1.0, 3)]:
        assert _limit(max_ratio, window) == math.floor(Fraction(max_ratio) * window)
    assert (_limit(0.3, 10), _limit(0.57, 100)) == (3, 57)


def _check_window_invariants(candidates: list[bool], drops: list[bool], max_ratio: float, window: int) -> None:
    assert not any(d and not c for d, c in zip(drops, candidates)), "dropped a non-candidate"
    prefix = [0]
    for d in drops:
        prefix.append(prefix[-1] + d)
    full = _limit(max_ratio, window)
    for end in range(1, len(drops) + 1):
        length = min(end, window)
        count = prefix[end] - prefix[end - length]
        # every contiguous window of `window` decisions, and every shorter prefix
        assert count <= _limit(max_ratio, length), (end, count)
        assert count <= full
        if candidates[end - 1] and not drops[end - 1]:
            # not conservative: this candidate was kept only because dropping it breaks the bound
            assert count + 1 > _limit(max_ratio, length), (end, count)


COMBOS = [(0.5, 10), (0.25, 8), (0.0, 5), (1.0, 3), (0.3, 7), (0.5, 1), (0.9, 20)]


@pytest.mark.parametrize("max_ratio,window", COMBOS)
@pytest.mark.parametrize("p_candidate", [0.3, 0.7, 1.0])
def test_window_mode_strict_limit_on_every_window(max_ratio, window, p_candidate):
    rng = random.Random(1234 + window)
    candidates = [rng.random() < p_candidate for _ in range(1000)]
    guard = DropFlagRatioGuard("window", max_ratio, window)
    drops = [guard.decide(c) for c in candidates]
    _check_window_invariants(candidates, drops, max_ratio, window)
    assert (guard.total, guard.filtered) == (1000, sum(drops))
    assert guard.window_drops == sum(drops[-window:])
    if max_ratio == 0.0:
        assert sum(drops) == 0
    if max_ratio == 1.0:
        assert drops == candidates


def test_window_mode_with_all_candidates_drops_exactly_half_of_every_window():
    guard = DropFlagRatioGuard("window", 0.5, 10)
    drops = [guard.decide(True) for _ in range(1000)]
    assert drops == [False, True] * 500
    assert all(sum(drops[i:i + 10]) == 5 for i in range(0, 991))
    assert guard.window_drops == 5 and guard.filtered == 500


def test_window_mode_quarter_of_eight_with_all_candidates():
    guard = DropFlagRatioGuard("window", 0.25, 8)
    drops = [guard.decide(True) for _ in range(400)]
    assert all(sum(drops[i:i + 8]) == 2 for i in range(0, 393))
    assert drops[:8] == [False, False, False, True, False, False, False, True]


def test_window_mode_equals_cumulative_while_the_window_fills():
    rng = random.Random(7)
    candidates = [rng.random() < 0.6 for _ in range(50)]
    window, cumulative = DropFlagRatioGuard("window", 0.5, 50), DropFlagRatioGuard("cumulative", 0.5)
    assert [window.decide(c) for c in candidates] == [cumulative.decide(c) for c in candidates]
    assert (window.total, window.filtered) == (cumulative.total, cumulative.filtered)


def test_window_mode_forgets_and_allows_a_bounded_burst():
    guard = DropFlagRatioGuard("window", 0.5, 10)
    for _ in range(20):
        assert guard.decide(False) is False
    burst = [guard.decide(True) for _ in range(10)]
    assert burst == [True] * 5 + [False] * 5
    assert guard.window_drops == 5 and (guard.total, guard.filtered) == (30, 5)
    # the cumulative guard would have dropped all ten (20 + 10 calls, 10 drops <= 15)
    cumulative = DropFlagRatioGuard("cumulative", 0.5)
    for _ in range(20):
        cumulative.decide(False)
    assert [cumulative.decide(True) for _ in range(10)] == [True] * 10


def test_window_of_one():
    guard = DropFlagRatioGuard("window", 0.99, 1)
    assert [guard.decide(True) for _ in range(5)] == [False] * 5
    guard = DropFlagRatioGuard("window", 1.0, 1)
    assert [guard.decide(True) for _ in range(3)] == [True] * 3


@pytest.mark.parametrize("mode", ["cumulative", "window"])
def test_state_dict_round_trip_continues_identically(mode):
    rng = random.Random(99)
    candidates = [rng.random() < 0.8 for _ in range(1000)]
    reference = DropFlagRatioGuard(mode, 0.3, 16)
    first = [reference.decide(c) for c in candidates[:500]]
    state = json.loads(json.dumps(reference.state_dict()))
    assert state["total"] == 500 and state["filtered"] == sum(first)
    assert state["recent"] == (first[-16:] if mode == "window" else [])
    restored = DropFlagRatioGuard(mode, 0.3, 16)
    restored.load_state_dict(state)
    rebuilt = DropFlagRatioGuard.from_state_dict(state)
    assert (rebuilt.mode, rebuilt.max_ratio, rebuilt.window) == (mode, 0.3, 16)
    rest = [reference.decide(c) for c in candidates[500:]]
    assert [restored.decide(c) for c in candidates[500:]] == rest
    assert [rebuilt.decide(c) for c in candidates[500:]] == rest
    assert restored.state_dict() == reference.state_dict() == rebuilt.state_dict()


def test_loading_a_cumulative_state_into_a_window_guard_starts_an_empty_window():
    source = DropFlagRatioGuard("cumulative")
    for _ in range(4):
        source.decide(True)
    guard = DropFlagRatioGuard("window", 0.5, 4)
    guard.load_state_dict(source.state_dict())
    assert (guard.total, guard.filtered, guard.window_drops) == (4, 2, 0)
    assert [guard.decide(True) for _ in range(4)] == [False, True, False, True]
    assert (guard.total, guard.filtered) == (8, 4)
    # a longer stored history than the configured window keeps its newest outcomes
    small = DropFlagRatioGuard("window", 0.5, 2)
    small.load_state_dict({"total": 3, "filtered": 2, "recent": [True, False, True]})
    assert small.state_dict()["recent"] == [False, True] and small.window_drops == 1


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "sliding"}, "mode must be one of"),
    ({"max_ratio": 1.5}, "max_ratio"),
    ({"max_ratio": -0.1}, "max_ratio"),
    ({"max_ratio": float("nan")}, "max_ratio"),
    ({"max_ratio": True}, "max_ratio"),
    ({"max_ratio": "0.5"}, "max_ratio"),
    ({"window": 0}, "window"),
    ({"window": 2.5}, "window"),
    ({"window": True}, "window"),
])
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DropFlagRatioGuard(**kwargs)


@pytest.mark.parametrize("state,match", [
    ([], "mapping"),
    ({"total": -1, "filtered": 0}, "total"),
    ({"total": 2, "filtered": 3}, "filtered 3 > total 2"),
    ({"total": 2, "filtered": 1, "recent": [1, 0]}, "list of bools"),
    ({"total": 1, "filtered": 1, "recent": [True, False]}, "inconsistent"),
    ({"total": 5, "filtered": 1, "recent": [True, True]}, "inconsistent"),
    ({"filtered": 0}, "total"),
])
def test_malformed_state_raises(state, match):
    guard = DropFlagRatioGuard("window", 0.5, 4)
    with pytest.raises(ValueError, match=match):
        guard.load_state_dict(state)
    assert (guard.total, guard.filtered) == (0, 0)
