"""The pure selection behind `rollstream replay`: predicates, ranges, JSON rendering."""

from __future__ import annotations

import math

import pytest

from rollstream.tools.replay import Predicate, Selection, jsonable, parse_time_ms, summary

GROUP = {"group_key": "p1", "domain": "gsm8k", "accepted": False, "reason": "zero_std",
         "decision_values": {"std": 0.0, "mean": 1.0, "rejected_responses/truncated": 2.0}, "rounds": 2,
         "responses": [{"response": {"domain": "gsm8k"}}]}


@pytest.mark.parametrize("text, expected", [
    ("reason=zero_std", True), ("reason!=zero_std", False), ("domain=math", False),
    ("decision_values.std=0", True), ("decision_values.mean>=1", True), ("decision_values.mean>1", False),
    ("rounds<3", True), ("rounds=2.0", True), ("accepted=false", True), ("accepted=true", False),
    ("missing=x", False), ("decision_values.missing!=x", False), ("responses.0=x", False),
    ("accepted=False", True), ("decision_values.rejected_responses/truncated>=1", True),
])
def test_predicates(text, expected):
    assert Predicate.parse(text).matches(GROUP) is expected


@pytest.mark.parametrize("bad", ["reason", "=x", "rounds>abc", "a b=c"])
def test_bad_predicates_say_the_accepted_form(bad):
    with pytest.raises(ValueError, match="bad predicate"):
        Predicate.parse(bad)


def test_selection_ranges_keys_partitions_and_undecodable_records():
    sel = Selection(from_offset=2, to_offset=5, since_ms=1000, until_ms=2000, key="p1", partitions=(0,),
                    predicates=(Predicate.parse("reason=zero_std"),))
    assert sel.matches(0, 2, 1000, b"p1", GROUP)
    assert not sel.matches(0, 5, 1000, b"p1", GROUP)  # to_offset is exclusive
    assert not sel.matches(0, 1, 1000, b"p1", GROUP)
    assert not sel.matches(0, 3, 2000, b"p1", GROUP)  # until is exclusive
    assert not sel.matches(0, 3, 999, b"p1", GROUP)
    assert not sel.matches(1, 3, 1500, b"p1", GROUP)
    assert not sel.matches(0, 3, 1500, b"p2", GROUP) and not sel.matches(0, 3, 1500, None, GROUP)
    assert not sel.matches(0, 3, 1500, b"p1", None)  # undecodable: only without predicates
    assert Selection().matches(7, 0, 0, None, None)


def test_json_rendering_and_times():
    assert jsonable({"payload": b"\x00\x01", "x": [math.nan, math.inf, 1.5]}) == {
        "payload": "AAE=", "x": ["NaN", "Infinity", 1.5]}
    assert parse_time_ms("1700000000000") == 1700000000000
    assert parse_time_ms("2026-11-29T23:00:00") == parse_time_ms("2026-11-29T23:00:00+00:00") == 1795993200000
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time_ms("yesterday")
    assert summary(GROUP) == ("reason=zero_std accepted=false domain=gsm8k values{std=0.0, mean=1.0, rejected_responses/truncated=2.0} "
                              "group_key=p1 rounds=2")
    assert summary(None) == "(undecodable)"
