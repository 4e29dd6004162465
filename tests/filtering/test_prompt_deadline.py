"""No prompt waits forever: the open round's request, its deadline, reissues and prompt_timeout."""

from __future__ import annotations

from rollstream.filtering.prompt_state import (
    Decided,
    DomainFilters,
    Reissue,
    Replacement,
    on_request,
    on_tick,
    step,
    with_request,
)

from .test_prompt_state import rr

F = DomainFilters(num_return_sequences=4, prompt_timeout_ms=1_000, max_reissues=2,
                  query_filter_config={"type": "std_filter", "filter_args": {"std_threshold": 0.0}})


def request(round_=0, n=4, offset=0, seed=11):
    return {"prompt_id": "p", "domain": "d", "mode": "train", "prompt": "q", "ground_truth": "1", "messages": [],
            "round": round_, "num_return_sequences": n, "sample_offset": offset, "seed": seed, "created_ms": 5}


def test_the_round_0_request_opens_the_state_with_its_deadline():
    state, changed = on_request(None, request(), F, now_ms=10_000)
    assert changed
    assert (state.expected, state.next_sample_index, state.deadline_ms, state.reissues) == ([0, 1, 2, 3], 4, 11_000, 0)
    assert state.request == {k: v for k, v in request().items() if k != "created_ms"}
    assert on_request(state, request(), F, now_ms=10_500) == (state, False)  # seen again: the deadline stays
    assert state.deadline_ms == 11_000


def test_a_request_after_its_responses_still_sets_the_deadline():
    state, _ = step(None, rr(0, 1.0), F)
    assert state.request is None and state.deadline_ms == 0
    assert on_tick(state, F, now_ms=10**12) == (state, [])  # no request seen: nothing to reissue yet
    state, changed = on_request(state, request(), F, now_ms=2_000)
    assert changed and state.deadline_ms == 3_000 and state.expected == [1, 2, 3]


def test_requests_of_other_rounds_and_decided_prompts_change_nothing():
    assert on_request(None, request(round_=1), F, now_ms=0) == (None, False)  # decided and forgotten
    state, _ = on_request(None, request(), F, now_ms=0)
    assert on_request(state, request(round_=2), F, now_ms=0) == (state, False)
    for i, reward in enumerate([1.0, 0.0, 0.0, 0.0]):
        state, _ = step(state, rr(i, reward), F)
    assert state.decided == "accepted"
    assert on_request(state, request(), F, now_ms=0) == (state, False)
    assert on_tick(state, F, now_ms=10**12) == (state, [])


def test_past_the_deadline_the_same_request_is_reissued_then_the_prompt_times_out():
    state, _ = on_request(None, request(), F, now_ms=0)
    state, _ = step(state, rr(0, 1.0), F)  # one of four arrived
    assert on_tick(state, F, now_ms=999) == (state, [])
    state, effects = on_tick(state, F, now_ms=1_000)
    assert effects == [Reissue(state.request, 1)] and state.deadline_ms == 2_000
    assert effects[0].request["seed"] == 11 and effects[0].request["sample_offset"] == 0  # the same seeds
    state, effects = on_tick(state, F, now_ms=2_500)
    assert effects == [Reissue(state.request, 2)] and state.deadline_ms == 3_500
    state, effects = on_tick(state, F, now_ms=3_500)
    assert effects == [Decided(False, "prompt_timeout", {"reissues": 2.0, "missing": 3.0, "accepted": 1.0,
                                                         "rounds": 1.0}, [0], 1, 1, {}, 3, (1.0,))]
    assert state.decided == "prompt_timeout" and state.request is None
    assert step(state, rr(1), F)[1][0].__class__.__name__ == "DuplicateResponse"  # a late sample: ignored


def test_a_replacement_round_drops_the_old_request_and_waits_for_its_own():
    state, _ = on_request(None, request(), F, now_ms=0)
    effects = []
    for i in range(4):
        state, e = step(state, rr(i, 0.0, finish="length" if i == 3 else "stop"), F)
        effects += e
    [replacement] = [e for e in effects if isinstance(e, Replacement)]
    assert (replacement.round, replacement.num_return_sequences, replacement.sample_offset) == (1, 1, 4)
    assert (state.request, state.deadline_ms) == (None, 0)  # the shell records the replacement's request
    state = with_request(state, request(round_=1, n=1, offset=4, seed=12), F, now_ms=7_000)
    assert state.deadline_ms == 8_000
    assert on_request(state, request(round_=1, n=1, offset=4, seed=12), F, now_ms=7_500) == (state, False)
    state, effects = on_tick(state, F, now_ms=8_000)
    assert effects == [Reissue(state.request, 1)] and state.request["round"] == 1


def test_no_reissue_allowed_times_out_at_the_first_deadline():
    f = DomainFilters(num_return_sequences=2, prompt_timeout_ms=50, max_reissues=0)
    state, _ = on_request(None, request(n=2), f, now_ms=0)
    state, [decided] = on_tick(state, f, now_ms=50)
    assert (decided.accepted, decided.reason, decided.values["missing"], decided.sample_indices) == (
        False, "prompt_timeout", 2.0, [])
