"""The per-prompt transaction: response filter, replacement rounds, query filter, redelivery."""

from __future__ import annotations

import math

import pytest

from rollstream.filtering.prompt_state import (
    Decided,
    DomainFilters,
    DuplicateResponse,
    Replacement,
    ResponseAccepted,
    ResponseRejected,
    step,
)

STD0 = {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}


def rr(index, reward=0.0, finish="stop", round_=0, tokens=3, mode="train", text="x", acc=None, invalid_format=False):
    return {
        "response": {"prompt_id": "p", "domain": "d", "mode": mode, "prompt": "q", "round": round_,
                     "sample_index": index, "prompt_length": 4, "response_length": tokens,
                     "finish_reason": finish, "policy_version": 3},
        "response_level_reward": reward,
        "scores": {"acc": reward if acc is None else acc},
        "meta": {"invalid_format": "true" if invalid_format else "false",
                 "blank_text": "false" if text.strip() else "true"},
        "payload": {"topic": "rollstream.responses", "partition": 0, "offset": index, "size_bytes": 64},
    }


def run(events, filters):
    state, all_effects = None, []
    for e in events:
        state, effects = step(state, e, filters)
        all_effects.extend(effects)
    return state, all_effects


def test_group_is_decided_once_when_complete():
    f = DomainFilters(num_return_sequences=4, query_filter_config=STD0)
    state, effects = run([rr(0, 1.0), rr(1), rr(2)], f)
    assert not any(isinstance(e, Decided) for e in effects)
    state, effects = step(state, rr(3), f)
    decided = [e for e in effects if isinstance(e, Decided)]
    assert decided == [Decided(True, "accepted", {"std": 0.5, "std_threshold": 0.0, "mean": 0.25},
                               [0, 1, 2, 3], 1, 4, {}, 3, (1.0, 0.0, 0.0, 0.0))]
    assert state.decided == "accepted" and state.accepted == {}


def test_redelivered_responses_never_reopen_or_double_count():
    f = DomainFilters(num_return_sequences=2, query_filter_config=STD0)
    state, effects = run([rr(0, 1.0), rr(0, 1.0), rr(1)], f)
    assert [type(e) for e in effects] == [ResponseAccepted, DuplicateResponse, ResponseAccepted, Decided]
    for e in (rr(0), rr(1)):
        state, effects = step(state, e, f)
        assert effects == [DuplicateResponse(e["response"]["sample_index"])]


def test_replacements_ask_for_exactly_the_rejected_count():
    f = DomainFilters(num_return_sequences=4, query_filter_config=STD0)
    state, effects = run([rr(0, 1.0), rr(1, finish="length"), rr(2), rr(3, finish="length")], f)
    assert effects[-1] == Replacement(round=1, num_return_sequences=2, sample_offset=4)
    for e in (rr(4, round_=1), rr(5, round_=1, tokens=0, text="")):
        state, effects = step(state, e, f)
    assert effects == [ResponseRejected(5, "empty_response"), Replacement(round=2, num_return_sequences=1, sample_offset=6)]
    state, effects = step(state, rr(6, round_=2), f)
    decided = effects[-1]
    assert isinstance(decided, Decided)
    assert (decided.accepted, decided.sample_indices, decided.rounds, decided.responses_generated) == (True, [0, 2, 4, 6], 3, 7)
    assert decided.rejected_responses == {"truncated": 2, "empty_response": 1}


def test_rounds_are_bounded_and_exhaustion_aborts_the_prompt():
    f = DomainFilters(num_return_sequences=2, query_filter_config=STD0, max_response_rounds=3)
    events = [rr(0, finish="error"), rr(1, 1.0)] + [rr(i, finish="error", round_=i - 1) for i in (2, 3)]
    state, effects = run(events, f)
    replacements = [e for e in effects if isinstance(e, Replacement)]
    assert replacements == [Replacement(1, 1, 2), Replacement(2, 1, 3)]
    decided = effects[-1]
    assert (decided.accepted, decided.reason) == (False, "response_retries_exhausted")
    assert decided.values == {"accepted": 1.0, "needed": 2.0, "rounds": 3.0}
    assert decided.sample_indices == [1]


@pytest.mark.parametrize("rounds", [1, 2, 5, 9])
def test_never_more_than_max_rounds_of_requests(rounds):
    f = DomainFilters(num_return_sequences=3, max_response_rounds=rounds)
    state, requested, index = None, 3, 0
    requests = 1
    while True:
        effects = []
        for _ in range(requested):
            state, effects = step(state, rr(index, finish="length"), f)
            index += 1
        follow = [e for e in effects if isinstance(e, Replacement)]
        if not follow:
            break
        requests += 1
        requested = follow[0].num_return_sequences
    assert requests == rounds
    assert state.decided == "response_retries_exhausted"


def test_nan_reward_rejected_at_response_level():
    f = DomainFilters(num_return_sequences=2)
    _, effects = run([rr(0, math.nan), rr(1)], f)
    assert effects[0] == ResponseRejected(0, "invalid_reward")


def test_invalid_format_rule_and_no_filter():
    strict = DomainFilters(num_return_sequences=1, response_filter_config={"type": "default", "filter_args": {"reject_invalid_format": True}})
    _, effects = step(None, rr(0, invalid_format=True), strict)
    assert effects[0] == ResponseRejected(0, "invalid_format")
    lax = DomainFilters(num_return_sequences=1, response_filter_config={"type": "no_filter"})
    _, effects = step(None, rr(0, finish="length", invalid_format=True), lax)
    assert isinstance(effects[0], ResponseAccepted)


def test_query_filter_reads_configured_metric_not_shaped_reward():
    # shaped rewards [0, 0, -0.617, -1.0] but raw acc all 0 -> zero_std on acc
    f = DomainFilters(num_return_sequences=4, query_filter_config={**STD0, "metric": "acc"})
    shaped = [0.0, 0.0, -0.617, -1.0]
    _, effects = run([rr(i, r, acc=0.0) for i, r in enumerate(shaped)], f)
    assert (effects[-1].accepted, effects[-1].reason, effects[-1].values["std"]) == (False, "zero_std", 0.0)
    f_shaped = DomainFilters(num_return_sequences=4, query_filter_config=STD0)
    _, effects = run([rr(i, r, acc=0.0) for i, r in enumerate(shaped)], f_shaped)
    assert effects[-1].accepted is True  # the phantom gradient the metric setting prevents


def test_validation_bypasses_response_and_query_filters():
    f = DomainFilters(num_return_sequences=4, query_filter_config=STD0, val_num_return_sequences=2)
    _, effects = run([rr(0, finish="length", mode="val"), rr(1, mode="val")], f)
    assert effects[-1] == Decided(True, "accepted", {}, [0, 1], 1, 2, {}, 3, (0.0, 0.0))
